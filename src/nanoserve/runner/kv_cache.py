"""The paged KV cache's shape and bytes: the one source for KV-cache sizes (the memory plan and the
benchmarks both ask it).

An fp8 cache (kernels/kv_quant.py) holds e4m3 codes, V transposed within each block (allocate), and its scales: per
token ("token": one bf16 value per token and kv head, K and V side by side, indexed like the cache without head_dim,
so the per-token bytes count them) or per layer
("layer": one fp32 value for K and one for V, the checkpoint's or 1.0), and its tail: each slot's newest two blocks
in the model's dtype, which a query reads its own block from (kernels/kv_quant.TAIL_BANKS; a fixed size, beside the
blocks).

On CPU the cache lives in an anonymous memory map: its pages read as zeros and cost memory only once a
block is written, so the process's footprint follows the tokens actually cached, not the cache's size
(zero-filling a 1 GiB cache at start-up made a 660 KB model idle at ~1 GB RSS).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from nanoserve.config import KV_CACHE_SCALES
from nanoserve.kernels.kv_quant import TAIL_BANKS, TOKEN_SCALE_DTYPE, is_fp8
from nanoserve.kernels.paging import blocks_for

KV_SCALE_DESIGNS = tuple(s for s in KV_CACHE_SCALES if s != "auto")  # what "auto" resolves to at start-up
DEFAULT_LAYER_SCALE = 1.0  # an uncalibrated per-layer scale (vLLM's default)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    scales: str | None = None  # an fp8 cache's scale design (KV_SCALE_DESIGNS); None for a model-dtype cache
    tail_slots: int = 0  # an fp8 cache's tail: the slots it holds (max_num_seqs and the dummy one); 0: none
    tail_dtype: torch.dtype | None = None  # the model's

    def __post_init__(self):
        if is_fp8(self.dtype) != (self.scales is not None) or self.scales not in (None,) + KV_SCALE_DESIGNS:
            raise ValueError(f"a {self.dtype} KV cache cannot have scales={self.scales!r}: an fp8 cache has "
                             f"{' or '.join(KV_SCALE_DESIGNS)} scales, another none")

    @classmethod
    def of(cls, model, block_size: int, dtype: torch.dtype, scales: str | None = None,
           max_num_seqs: int = 0) -> "KVCacheSpec":
        """max_num_seqs: an fp8 cache keeps a tail for that many slots (and the dummy one)."""
        tail = max_num_seqs + 1 if is_fp8(dtype) and max_num_seqs else 0
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, block_size, dtype, scales, tail,
                   model.dtype if tail else None)

    @property
    def tail_bytes(self) -> int:
        """The tail's bytes over every layer, K and V (fixed: it does not grow with the blocks)."""
        return 2 * self.num_layers * self._tail_rows * self.num_kv_heads * self.head_dim * self.tail_dtype.itemsize \
            if self.tail_slots else 0

    @property
    def _tail_rows(self) -> int:
        return self.tail_slots * TAIL_BANKS * self.block_size

    @property
    def bytes_per_token(self) -> int:
        per_head = self.head_dim * self.dtype.itemsize + (TOKEN_SCALE_DTYPE.itemsize if self.scales == "token" else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def allocate(self, model, num_blocks: int, device: torch.device) -> torch.Tensor:
        """One tensor [2, layers, num_blocks + 1, block_size · kv_heads · head_dim] (the extra block is the dummy
        that padded decode rows write); each attention layer gets [num_blocks + 1, block_size, kv_heads, head_dim]
        views of it. A model-dtype cache is token-major throughout; an fp8 cache stores V transposed within each
        block ([blocks, kv_heads, head_dim, block_size] behind the view, each head dimension's keys contiguous), the
        operand order fp8 tensor-core products need (kernels/attention_sm90.py), and its per-token scales as
        interleaved (K, V) pairs."""
        shape = (num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)
        cache = _zeros((2, self.num_layers, num_blocks + 1, math.prod(shape[1:])), self.dtype, device)
        scales = self._scales(model, shape[:-1], device)
        tail = _zeros((2, self.num_layers, self._tail_rows, self.num_kv_heads, self.head_dim), self.tail_dtype,
                      device) if self.tail_slots else None
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = cache[0, i].view(shape), _v_view(cache[1, i], shape, is_fp8(self.dtype))
            attn.k_scale, attn.v_scale = (None, None) if scales is None else scales[i]
            attn.k_tail, attn.v_tail = (None, None) if tail is None else (tail[0, i], tail[1, i])
        return cache

    def _scales(self, model, shape: tuple[int, ...], device: torch.device) -> list | None:
        """Each layer's (K scales, V scales): per token, zero views [blocks, block_size, kv_heads] of one tensor that
        holds a token's K and V scale side by side (the store writes them; one 4-byte read a key); per layer, two
        1-element fp32 tensors from the layer's checkpoint_kv_scales, else 1.0."""
        layers = model.attention_layers()
        if self.scales == "token":
            pairs = _zeros((self.num_layers, *shape, 2), TOKEN_SCALE_DTYPE, device)
            return [(pairs[i, ..., 0], pairs[i, ..., 1]) for i in range(self.num_layers)]
        if self.scales == "layer":
            values = [getattr(attn, "checkpoint_kv_scales", None) or (DEFAULT_LAYER_SCALE,) * 2 for attn in layers]
            scales = torch.tensor(values, dtype=torch.float32, device=device).reshape(-1, 2, 1)
            return [(s[0], s[1]) for s in scales]
        return None

    @staticmethod
    def release(model) -> None:
        for attn in model.attention_layers():
            attn.k_cache = attn.v_cache = attn.k_scale = attn.v_scale = attn.k_tail = attn.v_tail = None


def _v_view(storage: torch.Tensor, shape: tuple[int, ...], transposed: bool) -> torch.Tensor:
    """A layer's V cache as a [blocks, block_size, kv_heads, head_dim] view of its storage (transposed: stored
    [blocks, kv_heads, head_dim, block_size])."""
    if not transposed:
        return storage.view(shape)
    blocks, block_size, kv_heads, head_dim = shape
    return storage.view(blocks, kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def fp8_layout(v_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None):
    """A V cache [blocks, block_size, kv_heads, head_dim] and per-token (K, V) scales re-stored as allocate stores an
    fp8 cache's (the same values, the same views; per-layer scales as they are): for tests and benchmarks that
    build caches of their own."""
    v = _v_view(v_cache.permute(0, 2, 3, 1).contiguous(), tuple(v_cache.shape), True)
    if kv_scales is None or kv_scales[0].dim() != 3:
        return v, kv_scales
    pairs = torch.stack(kv_scales, dim=-1)
    return v, (pairs[..., 0], pairs[..., 1])


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _lazy_zeros(shape, dtype) if torch.device(device).type == "cpu" else \
        torch.zeros(shape, dtype=dtype, device=device)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous map: the kernel commits (and zeroes) a page when it is first written. The tensor
    holds the map; it is unmapped with the tensor's last reference."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
