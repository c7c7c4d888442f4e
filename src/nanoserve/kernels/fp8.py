"""FP8 (e4m3) weights: the format, quantize / dequantize, and the product of many rows (prefill).

A weight W [N, K] is stored as Q = round(W / s) in float8_e4m3fn with one fp32 scale s per output row (per
channel), or one per [BLOCK, BLOCK] tile as block-quantized checkpoints store it (`weight_block_size` [128, 128];
`block=(bn, bk)` gives other tiles for the quality comparison of benchmarks/fp8_quality.py): W ≈ Q · s. The scale maps the row's largest |w| to e4m3's largest finite value
(448), so nothing saturates and the 3-bit mantissa gives every weight ~2^-4 relative precision.

Few rows (decode) read Q and s in the Triton GEMV (kernels/gemv.py), which converts Q in registers and applies
s once per output; many rows (prefill) go through `linear` here, which PREFILL_TABLE sends either to
torch._scaled_mm (Hopper FP8 tensor cores: the activations quantized per token, scale_a per row, scale_b per
weight row) or to dequantize + the model-dtype matmul; off CUDA always the latter, so fp8 runs everywhere.
The quantization math lives here, under the kernels, because the run-time paths need it; model/quantization.py
decides which layers of a model it applies to.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanoserve.config import FP8_BLOCK

from nanoserve.kernels._triton import HAS_TRITON, jit, next_power_of_2, pdl_args, pdl_start, pdl_wait, tl, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row keeps a positive scale (its codes are all 0)
# The same as the kernels read them (a jit function may read a module global only if it is a constexpr).
FP8_MAX_K, MIN_SCALE_K = (tl.constexpr(FP8_MAX), tl.constexpr(MIN_SCALE)) if HAS_TRITON else (FP8_MAX, MIN_SCALE)
SCALED_MM, DEQUANT = "scaled_mm", "dequant"
BLOCK = FP8_BLOCK  # the side of the square tiles a block-scaled weight carries one scale for, and the activations'
SCALE_GROUP_K = tl.constexpr(BLOCK) if HAS_TRITON else BLOCK  # columns per activation scale (Fp8Rows)

# Tokens bucket (the smallest key >= rows; the last takes any) → ((weight MiB up to, None = any; method), ...).
# `python benchmarks/fp8_prefill.py` on the H200 measures both methods on the decode matrices of the three
# shapes at 128..8192 tokens and prints this dict to paste. Until that run: _scaled_mm everywhere (it reads half
# the weight bytes and runs the FP8 tensor cores at twice the bf16 rate; dequantizing first writes a bf16 copy).
PREFILL_TABLE: dict[int, tuple[tuple[float | None, str], ...]] = {
    8192: ((None, SCALED_MM),),
}


def quantize(weight: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q in float8_e4m3fn [N, K], fp32 scales) of weight [N, K]: scales [N] per output channel, or
    [cdiv(N, bn), cdiv(K, bk)] per block. Computed in fp32 on weight's device."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    if block is None:
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    bn, bk = block
    n, k = w.shape
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """Q · s in dtype, for either scale layout of quantize() (block as given to it)."""
    w = q.float()
    if block is None:
        if scale.shape != (q.shape[0],):
            raise ValueError(f"per-channel scales of a {tuple(q.shape)} weight are [{q.shape[0]}], "
                             f"got {tuple(scale.shape)} (blocks need block=)")
        return (w * scale[:, None]).to(dtype)
    n, k = q.shape
    full = scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return (w * full).to(dtype)


def scale_shape_ok(q: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether scale is a layout the run-time paths take for q [N, K]: per channel [N] or per BLOCK² tile."""
    n, k = q.shape
    return tuple(scale.shape) in ((n,), (-(-n // BLOCK), -(-k // BLOCK)))


def scale_block(q: torch.Tensor, scale: torch.Tensor) -> tuple[int, int] | None:
    """The block= of dequantize() for q's run-time scales: None per channel, (BLOCK, BLOCK) per tile."""
    if not scale_shape_ok(q, scale):
        raise ValueError(f"the scales of an fp8 {tuple(q.shape)} weight are [{q.shape[0]}] per channel or "
                         f"[cdiv(N, {BLOCK}), cdiv(K, {BLOCK})] per block, got {tuple(scale.shape)}")
    return (BLOCK, BLOCK) if scale.dim() == 2 else None


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] → (fp8 [M, K], fp32 scales [M, 1]): one scale per token, for torch._scaled_mm."""
    return quantize_groups(x, x.shape[1])


QUANTIZE_ROWS_MAX_K = 32768  # a row the kernel holds in registers at once (Llama-3.1-8B's widest input: 14336)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref as one Triton kernel on CUDA (a row per program: read once in bf16, written once in fp8;
    the six PyTorch ops of the reference move ~9 bytes a value, which at 8k prompt tokens cost as much as the
    product saves)."""
    m, k = x.shape
    if not use_triton(x) or k > QUANTIZE_ROWS_MAX_K or x.stride(1) != 1:
        return quantize_rows_ref(x)
    rows = _quantize(x, next_power_of_2(k), next_power_of_2(k))
    return rows.codes, rows.scales


@jit
def e4m3_rounded(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic, for the interpreter:
    its own fp32 → fp8 cast rounds ties up and does not carry a rounded-up mantissa into the exponent (127.9 → 64)."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: steps of 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    return ((v / step + 12582912.0) - 12582912.0) * step  # + 1.5 * 2^23 rounds to an integer, ties to even


class Fp8Rows(NamedTuple):
    """Activations quantized for a W8A8 product: e4m3 codes [M, K] and fp32 scales [M, cdiv(K, BLOCK)], one per
    token and BLOCK columns (quantize_groups(x, BLOCK)), and the dtype they were in (the product's output dtype).
    The kernel that produces the activations writes them so (fused.rms_norm / silu_and_mul with quantize=True,
    or quantize_activations), and the W8A8 GEMV reads them with its weight tiles."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def groups_ref(x: torch.Tensor) -> Fp8Rows:
    """The reference of every quantizing kernel: quantize_groups(x, BLOCK) of x's values in x's dtype."""
    return Fp8Rows(*quantize_groups(x, BLOCK), x.dtype)


GROUPS_BLOCK = 1024  # columns a program of _quantize_groups_kernel quantizes (8 groups)


def quantize_activations(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] as Fp8Rows, one Triton kernel on CUDA (for a W8A8 product whose input no kernel quantized)."""
    if not use_triton(x) or x.stride(1) != 1:
        return groups_ref(x)
    return _quantize(x, BLOCK, max(BLOCK, min(GROUPS_BLOCK, next_power_of_2(x.shape[1]))))


def _quantize(x: torch.Tensor, group: int, block: int) -> Fp8Rows:
    """x quantized per token and `group` columns (a power of two, <= block) by _quantize_groups_kernel."""
    m, k = x.shape
    rows = empty_rows(m, k, x.dtype, x.device, group)
    _quantize_groups_kernel[(m, -(-k // block))](x, rows.codes, rows.scales, k, x.stride(0), BLOCK=block, GROUP=group,
                                                 EXACT_CAST=not x.is_cuda, num_warps=max(4, min(16, block // 1024)),
                                                 **pdl_args(x.device))
    return rows


def empty_rows(m: int, k: int, dtype: torch.dtype, device, group: int = BLOCK) -> Fp8Rows:
    return Fp8Rows(torch.empty(m, k, dtype=FP8_DTYPE, device=device),
                   torch.empty(m, -(-k // group), dtype=torch.float32, device=device), dtype)


@jit
def store_groups(y, q_ptr, scale_ptr, row, col0, K, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                 EXACT_CAST: tl.constexpr):
    """Quantize y [BLOCK] (fp32: columns col0 … col0 + BLOCK of a row, col0 a multiple of GROUP, zeros past K) per
    GROUP columns, as quantize_groups: store the e4m3 codes at q_ptr [row, K] and the scales at scale_ptr
    [row, cdiv(K, GROUP)]."""
    groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(groups), axis=1), FP8_MAX_K), MIN_SCALE_K)
    v = tl.clamp(groups * tl.div_rn(1.0, scale)[:, None], -FP8_MAX_K, FP8_MAX_K)
    if EXACT_CAST:
        v = e4m3_rounded(v)
    cols = col0 + tl.arange(0, BLOCK)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, tl.reshape(v, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=cols < K)
    n_groups = tl.cdiv(K, GROUP)
    g = col0 // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(scale_ptr + row * n_groups + g, scale, mask=g < n_groups)


@jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                            EXACT_CAST: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    store_groups(y, q_ptr, scale_ptr, row, tl.program_id(1) * BLOCK, K, BLOCK, GROUP, EXACT_CAST)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] → (fp8 [M, K], fp32 scales [M, cdiv(K, group)]): one scale per token and `group` columns
    (the reference of the kernels that write Fp8Rows, with group = BLOCK)."""
    m, k = x.shape
    tiles = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = (tiles.abs().amax(dim=2) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles * (1.0 / scale)[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return q.contiguous(), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 activations quantize_groups' codes and scales stand for."""
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :q.shape[1]]


def _parsed_table(table: dict) -> dict[int, tuple[tuple[float, str], ...]]:
    out = {}
    for rows, entries in sorted(table.items()):
        limits = [math.inf if mib is None else mib * 2**20 for mib, _ in entries]
        if not entries or limits[-1] != math.inf or limits != sorted(set(limits)):
            raise ValueError(f"PREFILL_TABLE[{rows}]: sizes must ascend and end with None (any size)")
        if any(method not in (SCALED_MM, DEQUANT) for _, method in entries):
            raise ValueError(f"PREFILL_TABLE[{rows}]: methods are {SCALED_MM!r} or {DEQUANT!r}")
        out[rows] = tuple(zip(limits, (method for _, method in entries)))
    return out


_TABLE = _parsed_table(PREFILL_TABLE)


def prefill_method(m: int, n: int, k: int) -> str:
    """The faster method for m rows times an fp8 [n, k] weight on the GPU, from PREFILL_TABLE."""
    keys = sorted(_TABLE)
    bucket = next((b for b in keys if b >= m), keys[-1])
    for limit, method in _TABLE[bucket]:
        if n * k <= limit:
            return method
    raise AssertionError("unreachable: the last entry takes any size")


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_applies(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether torch._scaled_mm's row-wise path takes these: CUDA with FP8 tensor cores, bf16 activations (its
    only output type with row-wise scales), per-channel scales, K and N multiples of 16."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or scale.dim() != 1 or x.dim() != 2:
        return False
    if x.shape[1] % 16 or q.shape[0] % 16 or (bias is not None and bias.dtype != torch.bfloat16):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _has_fp8_tensor_cores(index)


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (Q · s).T + bias on the FP8 tensor cores: x quantized per token, accumulated in fp32, out in bf16."""
    xq, x_scale = quantize_rows(x)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype, use_fast_accum=False)


def dequant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (Q · s).T + bias with the weight dequantized to x's dtype first (any device; either scale layout)."""
    return F.linear(x, dequantize(q, scale, x.dtype, scale_block(q, scale)), bias)


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           method: str | None = None) -> torch.Tensor:
    """x [..., K] @ (Q · s).T + bias for many rows: PREFILL_TABLE's method where _scaled_mm applies (or `method`),
    else dequantize + matmul."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 linear needs a {FP8_DTYPE} weight, got {q.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if scaled_mm_applies(x2, q, scale, bias):
        method = method or prefill_method(x2.shape[0], q.shape[0], q.shape[1])
    else:
        method = DEQUANT
    out = scaled_mm_linear(x2, q, scale, bias) if method == SCALED_MM else dequant_linear(x2, q, scale, bias)
    return out.view(*lead, q.shape[0])
