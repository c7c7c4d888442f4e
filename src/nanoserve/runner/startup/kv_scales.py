"""Which scales an fp8 KV cache uses (EngineConfig.kv_cache_scales), decided once the model is loaded: "auto" follows
the checkpoint, whose per-layer KV scales (the loader's `checkpoint_kv_scales` on each Attention) are what the model
was calibrated with; without them a scale per token and KV head, computed as K/V are stored, needs no calibration."""
from __future__ import annotations

from nanoserve.config import EngineConfig


def resolve_kv_scales(config: EngineConfig, model) -> str | None:
    """"token" or "layer" for an fp8 cache ("auto": "layer" when the checkpoint carries KV scales, else "token");
    None for a cache in the serving dtype. A checkpoint with KV scales on some layers only is a ValueError."""
    if config.kv_cache_dtype != "fp8":
        return None
    scaled = [getattr(attn, "checkpoint_kv_scales", None) is not None for attn in model.attention_layers()]
    if any(scaled) and not all(scaled):
        missing = scaled.index(False)
        raise ValueError(f"the checkpoint has KV-cache scales for {sum(scaled)} of {len(scaled)} attention layers "
                         f"(none for layer {missing}): an fp8 KV cache needs them on every layer or on none")
    if config.kv_cache_scales != "auto":
        return config.kv_cache_scales
    return "layer" if any(scaled) else "token"


__all__ = ["resolve_kv_scales"]
