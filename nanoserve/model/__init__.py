"""Model definitions (Llama family) and the Hugging Face folder loader."""
from nanoserve.model.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from nanoserve.model.loader import (ModelLoadError, eos_token_ids, load_hf_config, load_model, load_tokenizer,
                                    model_max_len)

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelLoadError", "eos_token_ids", "load_hf_config",
           "load_model", "load_tokenizer", "model_max_len"]
