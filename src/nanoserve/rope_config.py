"""What a model's config says about its rotary embedding: rope_parameters, the one flat, checked dict of RoPE settings
that model/layers.py's rope_inv_freq and RotaryEmbedding read. A ground module beside model_files (which re-exports
it): no torch, so the API process checks a config without it.
"""
from __future__ import annotations

# RoPE variants that are a fixed function of the position (their cos/sin is cached once and keys stored in the
# paged cache stay valid), with the settings each needs; "dynamic" rescales with the sequence length.
_ROPE_SETTINGS = {"default": (), "linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "yarn": ("original_max_position_embeddings",),
                  # one factor set fixed for the engine by its max length: model/layers.py's _longrope_inv_freq
                  "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor")}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_SETTINGS)


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings as one flat dict with rope_type, rope_theta and partial_rotary_factor (1.0 unless
    the config rotates only part of each head) (transformers 4.x or 5.x layout), checked: a supported rope_type with
    every setting it needs (model/layers.py's rope_inv_freq reads them)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_type" not in params and "rope_theta" not in params:
        raise ValueError(f"per-layer RoPE parameters {sorted(params)} are not supported")
    rope_type = params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type not in _ROPE_SETTINGS:
        why = " (it rescales with the sequence length, so cached keys would go stale)" if rope_type == "dynamic" else ""
        raise ValueError(f"unsupported rope_type {rope_type!r}{why}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    params["partial_rotary_factor"] = 1.0 if factor is None else float(factor)  # rotary_dim = int(head_dim · this)
    if not 0.0 < params["partial_rotary_factor"] <= 1.0:
        raise ValueError(f"partial_rotary_factor={factor} must be in (0, 1]")
    if getattr(hf_config, "original_max_position_embeddings", None) is not None:  # Phi-3 under transformers 4.x
        params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    if rope_type == "longrope" and params.get("factor") is None and "original_max_position_embeddings" in params:
        # HF's default, from the config rather than the engine's max length (which picks the factor set)
        params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    for name in _ROPE_SETTINGS[rope_type]:
        if name not in params:
            raise ValueError(f"rope_type {rope_type!r} needs the setting {name!r}")
    return params
