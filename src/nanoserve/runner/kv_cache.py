"""The paged KV cache's shape and bytes: the one source for KV-cache sizes (the memory plan and the
benchmarks both ask it).

On CPU the cache lives in an anonymous memory map: its pages read as zeros and cost memory only once a
block is written, so the process's footprint follows the tokens actually cached, not the cache's size
(zero-filling a 1 GiB cache at start-up made a 660 KB model idle at ~1 GB RSS).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from nanoserve.kernels.paging import blocks_for


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, block_size, dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def allocate(self, model, num_blocks: int, device: torch.device) -> torch.Tensor:
        """One tensor [2, layers, num_blocks + 1, block_size, kv_heads, head_dim] (the extra block is the dummy
        that padded decode rows write); each attention layer gets views of it."""
        shape = (2, self.num_layers, num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)
        cache = _lazy_zeros(shape, self.dtype) if torch.device(device).type == "cpu" else \
            torch.zeros(shape, dtype=self.dtype, device=device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
        return cache

    @staticmethod
    def release(model) -> None:
        for attn in model.attention_layers():
            attn.k_cache = attn.v_cache = None


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous map: the kernel commits (and zeroes) a page when it is first written. The tensor
    holds the map; it is unmapped with the tensor's last reference."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
