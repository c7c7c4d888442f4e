"""The engine's start-up line: what it runs, in one line (architecture, dtype, limits, KV cache, graphs,
speculation), from the resolved config, the runner's info and the block manager."""
from __future__ import annotations

import os

from nanoserve.config import EngineConfig
from nanoserve.kernels.paging import blocks_for


def ready_line(config: EngineConfig, info, hf_config, window: int | None, seconds: float) -> str:
    c, r = config, info
    gib = r.num_kv_blocks * r.kv_block_bytes / 2**30
    graphs = list(r.decode_graph_sizes)
    shown = f"CUDA graphs for {len(graphs)} batch sizes {graphs}" if graphs else \
        "no CUDA graphs (" + ("enforce_eager" if c.enforce_eager else "no CUDA device") + ")"
    spec = c.speculative
    drafter = f" {os.path.basename(spec.model.rstrip('/'))}" if spec is not None and spec.model else ""
    drafts = "" if spec is None else (f"; speculative decoding: {spec.method}{drafter}, up to "
                                      f"{spec.num_speculative_tokens} drafts"
                                      f"{' (planned per step)' if spec.adaptive else ''}")
    return (f"engine ready in {seconds:.1f} s: {_architecture(hf_config)}, {c.dtype} on {c.device}"
            f"{f', tp={c.tensor_parallel_size}' if c.tensor_parallel_size > 1 else ''}, max_model_len "
            f"{c.max_model_len}, max_num_seqs {c.max_num_seqs}; KV cache {_kv_cache_kind(r)}: {gib:.2f} GiB = "
            f"{r.num_kv_blocks * c.block_size} tokens ({r.num_kv_blocks} blocks of {c.block_size}, "
            f"{r.kv_block_bytes} bytes each{_window_note(c, window)}); {shown}{drafts}")


def _window_note(config: EngineConfig, window: int | None) -> str:
    """With a window on every layer, a decoding sequence holds at most the blocks of its window."""
    if window is None:
        return ""
    held = blocks_for(config.max_model_len, config.block_size, window)
    return f"; sliding window {window} on every layer: a decoding sequence holds at most {held} blocks"


def _kv_cache_kind(info) -> str:
    """The cache's element type and, for fp8, its scale design: "bfloat16", "float8_e4m3fn with per-token scales"."""
    return info.kv_cache_dtype + (f" with per-{info.kv_cache_scales} scales" if info.kv_cache_scales else "")


def _architecture(hf_config) -> str:
    return (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]


__all__ = ["ready_line"]
