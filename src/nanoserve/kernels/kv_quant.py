"""The fp8 (e4m3) KV cache's number format: how a K or V row becomes codes and a scale, in PyTorch (the oracle and
the CPU path) and in Triton (inlined into the kernels that store K/V).

Two scale designs share one layout, so every kernel reads both the same way: a scale tensor indexed like the cache
without its head_dim ([num_blocks, block_size, num_kv_heads]). "token": one bf16 scale per token and kv head, amax / 448,
written by the store; "layer": one fp32 scale for the whole layer (a 1-element tensor that the kernels read with zero
strides), fixed at start-up. Codes are round-to-nearest-even of x / scale clamped to ±448, computed so that the
Triton interpreter, the GPU and torch give the same bits (the interpreter's own fp32 → fp8 conversion rounds ties
away from zero and flushes subnormals; the GPU's cvt rounds to even): the value is first rounded to e4m3's precision
in fp32 arithmetic, after which the conversion is exact everywhere.
"""
from __future__ import annotations

import torch

from nanoserve.kernels._triton import jit, tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
TOKEN_SCALE_DTYPE = torch.bfloat16  # 2 bytes per head row: 1.6% of an fp8 head_dim-128 row (fp32 would be 3.1%)
_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()  # the fp32 constant both sides multiply by


# The tail: an fp8 cache keeps each sequence's newest two blocks in the model's dtype too, [slots, TAIL_BANKS,
# block_size, num_kv_heads, head_dim] per layer for K and for V (bank = block index mod 2), and a query reads the keys of
# its own block from there, exact (SmolLM2's top-1 agreement with bf16 KV: 0.962 → 0.975, measured in emulation:
# benchmarks/results/kv_quality_windows_smollm2_cpu.json). Key j is exact for the query at position p iff
# j // block_size == p // block_size; the value read is the token's K/V in the model's dtype: from the step's own k/v
# when the token is one of the step's, else from its tail row. Two banks, so a step whose tokens cross a block
# boundary (a verification) does not overwrite the keys its first rows read.
TAIL_BANKS = 2


def tail_row(slots, positions, block_size: int):
    """The tail row (of the flattened [slots * TAIL_BANKS * block_size] rows) of the token at `positions` of the
    sequence in slot `slots`: numpy or torch integers alike."""
    return (slots * TAIL_BANKS + (positions // block_size) % TAIL_BANKS) * block_size + positions % block_size


@jit
def tail_row_tl(slot, positions, BLOCK_SIZE: tl.constexpr):
    """tail_row inside a kernel (2: TAIL_BANKS)."""
    return (slot * 2 + (positions // BLOCK_SIZE) % 2) * BLOCK_SIZE + positions % BLOCK_SIZE


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot-in-block, kv head) strides of a scale tensor: a per-layer scale is read with zero strides."""
    if scale.dim() == 3:
        return scale.stride(0), scale.stride(1), scale.stride(2)
    if scale.numel() != 1:
        raise ValueError(f"a KV scale is [num_blocks, block_size, num_kv_heads] or one value, got {tuple(scale.shape)}")
    return 0, 0, 0


def per_token(scale: torch.Tensor) -> bool:
    return scale.dim() == 3


def kernel_args(cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None):
    """What the attention kernels take about a cache's format: (k_scale, v_scale, block / slot / head strides of the
    scales) and the FP8 / TOKEN_SCALES constexprs. A model-dtype cache passes the cache itself as an unused pointer."""
    if kv_scales is None:
        if is_fp8(cache.dtype):
            raise ValueError("an fp8 KV cache needs its K and V scales (kv_scales)")
        return (cache, cache, 0, 0, 0), {"FP8": False, "TOKEN_SCALES": False}
    k_scale, v_scale = kv_scales
    if not is_fp8(cache.dtype):
        raise ValueError(f"KV scales were given for a {cache.dtype} cache: they belong to an fp8 one")
    strides = scale_strides(k_scale)
    if scale_strides(v_scale) != strides or v_scale.shape != k_scale.shape:
        raise ValueError(f"K and V scales differ in layout: {tuple(k_scale.shape)} vs {tuple(v_scale.shape)}")
    if per_token(k_scale) and tuple(k_scale.shape) != tuple(cache.shape[:3]):
        raise ValueError(f"per-token KV scales {tuple(k_scale.shape)} do not match the cache {tuple(cache.shape)}")
    return (k_scale, v_scale, *strides), {"FP8": True, "TOKEN_SCALES": per_token(k_scale)}


def token_scales_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] → the per-row scale amax / 448 in TOKEN_SCALE_DTYPE (1 for an all-zero row)."""
    amax = x.float().abs().amax(dim=-1)
    s = (amax * _INV_FP8_MAX).to(TOKEN_SCALE_DTYPE)
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] → (e4m3 codes, scale): with scale None one per row (token_scales_ref), else the given
    per-layer scale (one value)."""
    if scale is None:
        scale = token_scales_ref(x)
        divisor = scale.float()[..., None]
    else:
        divisor = scale.float().reshape(())
    codes = (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_ref(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., head_dim] with their per-row scales [...] (or one per-layer value) → values in dtype."""
    s = scale.float()
    s = s.reshape(()) if s.numel() == 1 else s[..., None]
    return (codes.float() * s).to(dtype)


@jit
def fp8_codes(x, scale):
    """fp32 values / scale → e4m3 values (still fp32: exactly representable, so the caller's .to(fp8) is exact),
    rounded to nearest even and clamped to ±448. Normal range: round the fp32 mantissa to 3 bits in integer
    arithmetic; below 2^-6 (e4m3's subnormals, multiples of 2^-9): add and subtract 2^14, whose fp32 ulp is 2^-9."""
    return e4m3_nearest(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0))


@jit
def e4m3_nearest(y):
    """fp32 y within ±448 → the nearest e4m3 value (ties to even), still fp32: fp8_codes' rounding."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    tiny = ((tl.abs(y) + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | (bits & -2147483648)  # y's sign, even on 0
    return tl.where(tl.abs(y) < 0.015625, tiny.to(tl.float32, bitcast=True), normal)


@jit
def _round_to_bf16(x):
    """fp32 → the nearest bf16 value (ties to even), still fp32: in integer arithmetic, as fp8_codes (the
    interpreter's own conversion does not round to nearest even)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@jit
def quantize_rows(x, scale_ptrs, row_ok, TOKEN_SCALES: tl.constexpr):
    """Rows x [R, D] → their e4m3 values (fp32, fp8_codes). scale_ptrs [R, 1]: with TOKEN_SCALES each row's scale
    (token_scales_ref's, rounded to the scale tensor's bf16) is computed and stored there, else the layer's one scale
    is read from there (zero strides)."""
    x = x.to(tl.float32)
    if TOKEN_SCALES:
        scale = _round_to_bf16(tl.max(tl.abs(x), axis=1, keep_dims=True) * (1.0 / 448.0))
        scale = tl.where(scale > 0, scale, 1.0)
        tl.store(scale_ptrs, scale.to(scale_ptrs.dtype.element_ty), mask=row_ok)
    else:
        scale = tl.load(scale_ptrs, mask=row_ok, other=1.0).to(tl.float32)
    return fp8_codes(x, scale)
