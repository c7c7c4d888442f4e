"""The paged KV cache's addressing, the one definition the engine, the runner and the kernels' references share:
a sequence's tokens live in fixed-size blocks listed by its block table; token position p is in block
table[p // block_size], at offset p % block_size; its slot in a cache [num_blocks, block_size, ...] is
block_id * block_size + offset (what slot_mapping holds and the attention kernels read). The kernels address a
block's token by (block, offset) through the cache's strides, so an fp8 cache may store V transposed within each
block (runner/kv_cache.py).
"""
from __future__ import annotations

import numpy as np


def blocks_for(num_tokens: int, block_size: int, window: int | None = None) -> int:
    """Blocks that hold num_tokens tokens (a partly filled last block counts). With a sliding window on every layer
    (the engine frees the blocks that slid out of it), the most a decoding sequence of num_tokens tokens holds: its
    query's `window` keys (itself included) span at most blocks_for(window - 1) + 1 blocks."""
    blocks = -(-num_tokens // block_size)
    return blocks if window is None else min(blocks, -(-(window - 1) // block_size) + 1)


def kv_slots(tables, positions, block_size: int) -> np.ndarray:
    """The int32 KV-cache slots of token positions. tables is one of:
    - one sequence's block table (a list or 1-D array): every position reads it, the result has positions' shape;
    - a [rows, blocks] array: every row reads every position, [rows, *positions' shape];
    - a list of sequences' block tables (lists), one per position (a decode step's rows): [len(positions)]."""
    positions = np.asarray(positions)
    index = positions // block_size
    if isinstance(tables, list) and tables and isinstance(tables[0], list):
        blocks = np.fromiter(map(list.__getitem__, tables, index.tolist()), np.int64, len(tables))
    else:
        blocks = np.asarray(tables)[..., index]
    return (blocks * block_size + positions % block_size).astype(np.int32)


def require_cache_layout(name: str, k_cache, v_cache, token_scales=None) -> None:
    """The layouts the kernels address: K [blocks, block_size, kv_heads, head_dim] with a contiguous head_dim; V the
    same, or transposed within its blocks (the keys of a head dimension contiguous: an fp8 cache's, KVCacheSpec);
    per-token scales indexed by slot = block * block_size + offset (a block's stride block_size slots)."""
    if k_cache.stride(-1) != 1 or 1 not in (v_cache.stride(-1), v_cache.stride(1)):
        raise ValueError(f"{name}: cache strides {k_cache.stride()} / {v_cache.stride()} (shape "
                         f"{tuple(k_cache.shape)}): K needs a contiguous head_dim, V a contiguous head_dim or block")
    for scale in token_scales or ():
        if scale.stride(0) != scale.shape[1] * scale.stride(1):
            raise ValueError(f"{name}: KV scale strides {scale.stride()} do not allow slot indexing "
                             f"(shape {tuple(scale.shape)})")


__all__ = ["blocks_for", "kv_slots", "require_cache_layout"]
