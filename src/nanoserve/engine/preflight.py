"""What the model's config and this machine decide alone, checked before any process starts or weight is read.

The API process runs these checks before it loads a tokenizer or starts the engine core, and the core runs
them again before it builds its runner (the offline LLM's only check), so a model that tensor_parallel_size
ranks cannot share, a dtype the device lacks, or a pre-quantized checkpoint fails in a second with one line,
not after the weights are loaded.
"""
from __future__ import annotations

import torch

from nanoserve.config import EngineConfig, hf_config_dtype
from nanoserve.model_files import ModelSpec
from nanoserve.model_files import load_draft_hf_config, load_hf_config, model_max_len, text_config
from nanoserve.model.communicator import check_sharding
from nanoserve.runner.parallel.distributed import check_world


def check_engine_config(config: EngineConfig, hf_config=None):
    """(the resolved EngineConfig, the model's HF config); ValueError naming the first thing that cannot run.
    hf_config: the model's config when already loaded (load_hf_config validates the architecture, its
    features and its weight format)."""
    if hf_config is None:
        hf_config = load_hf_config(config.model)
    resolved = config.resolve(model_max_len(hf_config), hf_config_dtype(hf_config))
    check_world(resolved)
    check_sharding(ModelSpec.from_hf_config(hf_config), resolved.tensor_parallel_size)
    check_dtype(resolved)
    check_draft_model(resolved, hf_config)
    return resolved, hf_config


def check_draft_model(config: EngineConfig, hf_config) -> None:
    """A draft model (speculative_config "draft_model") must propose only the target's token ids, reach
    max_model_len, and run where the target runs (one GPU: its KV cache shares the target's blocks)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return
    draft = load_draft_hf_config(spec.model)
    ours, theirs = text_config(hf_config).vocab_size, text_config(draft).vocab_size
    if theirs > ours:  # (smaller is fine: Qwen2.5's small models pad their embedding to fewer rows than 7B's)
        raise ValueError(f"speculative_config: the draft model's vocabulary ({theirs} tokens) is larger than the "
                         f"model's ({ours}); a draft model must share the model's tokenizer")
    if model_max_len(draft) < config.max_model_len:
        raise ValueError(f"speculative_config: the draft model reaches {model_max_len(draft)} tokens, fewer than "
                         f"max_model_len={config.max_model_len}; lower max_model_len")
    if config.tensor_parallel_size != 1:
        raise ValueError("speculative_config: a draft model runs with tensor_parallel_size=1 only")



def check_dtype(config: EngineConfig) -> None:
    """bfloat16 needs a GPU of compute capability 8.0 or newer (CPUs emulate it; float16 runs everywhere); an fp8 KV
    cache 8.9 or newer (the float8 e4m3 conversions its kernels use: Ada, Hopper and later)."""
    device = config.torch_device
    needs = [("dtype=bfloat16", (8, 0), "use --dtype float16")] if config.dtype == "bfloat16" else []
    if config.kv_cache_dtype == "fp8":
        needs.append(("kv_cache_dtype=fp8", (8, 9), "leave --kv-cache-dtype auto"))
    if device.type != "cuda" or not needs:
        return
    for rank in range(config.tensor_parallel_size):
        index = (device.index or 0) + rank
        capability = torch.cuda.get_device_capability(index)
        for what, needed, instead in needs:
            if capability < needed:
                raise ValueError(f"{what} needs a GPU of compute capability {needed[0]}.{needed[1]} or newer; "
                                 f"cuda:{index} is {capability[0]}.{capability[1]}: {instead}")
