"""nanoserve: a small LLM inference engine built around CUDA-graph decode."""
import logging
import os

# Start-up facts (memory plan, captured graphs, KV blocks) are logged at INFO on the "nanoserve" logger;
# NANOSERVE_LOG_LEVEL=WARNING quiets them. The handler is the package's own, so the root logger is untouched.
_logger = logging.getLogger("nanoserve")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(asctime)s nanoserve %(levelname)s %(message)s", "%H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.setLevel(os.environ.get("NANOSERVE_LOG_LEVEL", "INFO").upper())
    _logger.propagate = False

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): `nanoserve --version` and argument errors must not pay for torch.
_LAZY = {"LLM": "nanoserve.llm", "SamplingParams": "nanoserve.sampling", "StructuredOutputsParams": "nanoserve.sampling",
         "EngineConfig": "nanoserve.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
