"""nanoserve: a small LLM inference engine built around CUDA-graph decode."""
from nanoserve.config import EngineConfig
from nanoserve.llm import LLM
from nanoserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"
