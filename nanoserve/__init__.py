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

from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.llm import LLM  # noqa: E402
from nanoserve.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"
