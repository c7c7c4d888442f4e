"""Paged attention entry point: store this step's k/v in the cache, then attend.

Two backends with one contract: "torch" (torch_ref.py; CPU and test oracle) and "triton"
(triton_kernels.py; CUDA). The backend is chosen once per model, never per call.
"""
from __future__ import annotations

import importlib.util

import torch

from nanoserve.attention import torch_ref
from nanoserve.attention.metadata import AttentionMetadata


def select_backend(device: torch.device) -> str:
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, backend: str,
                    kv_stored: bool = False) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the T new tokens → attention output [T, H, D].

    kv_stored: the caller already wrote k/v into the cache (fused into its rotary kernel)."""
    if backend == "triton":
        from nanoserve.attention import triton_kernels as impl
    else:
        impl = torch_ref
    if not kv_stored:
        impl.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_prefill:
        return impl.prefill_attention(q, k, v, k_cache, v_cache, meta, scale)
    return impl.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)


__all__ = ["AttentionMetadata", "paged_attention", "select_backend"]
