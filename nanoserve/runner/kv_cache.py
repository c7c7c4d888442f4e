"""The paged KV cache's shape and bytes: the one source for KV-cache sizes (the memory plan and the
benchmarks both ask it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return -(-num_tokens // self.block_size)

    def allocate(self, model, num_blocks: int, device: torch.device) -> torch.Tensor:
        """One tensor [2, layers, num_blocks + 1, block_size, kv_heads, head_dim] (the extra block is the dummy
        that padded decode rows write); each attention layer gets views of it."""
        cache = torch.zeros(2, self.num_layers, num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim,
                            dtype=self.dtype, device=device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
        return cache

    @staticmethod
    def release(model) -> None:
        for attn in model.attention_layers():
            attn.k_cache = attn.v_cache = None
