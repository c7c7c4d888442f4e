"""The paged KV cache's addressing, the one definition the engine, the runner and the kernels' references share:
a sequence's tokens live in fixed-size blocks listed by its block table; token position p is in block
table[p // block_size], at offset p % block_size; its slot in a cache [num_blocks, block_size, ...] is
block_id * block_size + offset (what slot_mapping holds and the attention kernels read).
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


__all__ = ["blocks_for", "kv_slots"]
