"""Structured outputs' token bitmask applied on the device, fused with the sampler's float32 copy of the logits.

The sampler works on a float32 copy of the logits; a constrained step also sets the tokens its grammar forbids to
-inf. xgrammar's apply_token_bitmask_inplace does that in place, but its Python wrapper costs ~0.18 ms of host time
a call (H200 host, 64 rows: device-property lookups and a generic launch), on the critical path of a loop that is
host-bound at that batch size. One kernel here reads the logits and the packed mask once and writes the masked
float32 copy. The mask is xgrammar's layout: [rows, ceil(vocab / 32)] int32, bit j of word w allows token 32w + j.
"""
from __future__ import annotations

import torch

from nanoserve.kernels._triton import HAS_TRITON, cdiv, jit, tl

BLOCK = 2048  # tokens per program: 64 rows of a 152k vocabulary are ~4.8k programs


def masked_float_logits_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, vocab] with every token whose bit is 0 at -inf (plain PyTorch)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    return logits.float().masked_fill(~allowed, float("-inf"))


def masked_float_logits(logits: torch.Tensor, bitmask: torch.Tensor, force_triton: bool = False) -> torch.Tensor:
    """float32 logits [n, vocab] with every token whose bit is 0 at -inf; bitmask [n, >= ceil(vocab / 32)] int32 on
    the logits' device. A new tensor: the logits are left as they are."""
    n, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != n or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a token bitmask for {n} rows of {vocab} tokens is int32 [{n}, >= {cdiv(vocab, 32)}], "
                         f"got {bitmask.dtype} {list(bitmask.shape)}")
    if not (force_triton or (HAS_TRITON and logits.is_cuda)):
        return masked_float_logits_ref(logits, bitmask)
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n:
        _masked_float_logits_kernel[(n, cdiv(vocab, BLOCK))](logits, bitmask, out, vocab, logits.stride(0),
                                                            bitmask.stride(0), BLOCK=BLOCK)
    return out


@jit
def _masked_float_logits_kernel(logits_ptr, mask_ptr, out_ptr, vocab, stride_logits, stride_mask,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=inside, other=0.0).to(tl.float32)
    words = tl.load(mask_ptr + row * stride_mask + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(out_ptr + row * vocab + cols, tl.where(allowed, x, float("-inf")), mask=inside)

