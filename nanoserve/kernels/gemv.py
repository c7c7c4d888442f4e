"""Skinny matmul for decode: out = x @ W.T (+ bias) for a few rows x, as ONE Triton kernel.

At decode every linear layer multiplies M = batch-size rows (1..16) by a weight W [N, K] that is
read once from HBM, so its time is bytes(W) / bandwidth plus a fixed latency. cuBLAS's tiles are
made for large M: on mid-size matrices at M = 1 it reaches a third of HBM bandwidth, and where it
splits K it launches a second reduce kernel, which inside a CUDA graph costs another launch gap.

The kernel (`_gemv_kernel`):
  * grid (cdiv(N, BLOCK_N), SPLIT_K): program (n, s) computes out[:, n*BLOCK_N : (n+1)*BLOCK_N]
    over the s-th slice of K, for all M rows at once, so W is read exactly once;
  * per iteration a [BLOCK_N, BLOCK_K] weight tile is read along K (W is row-major, so a thread
    reads 16 contiguous bytes) and the loop is software-pipelined (`tl.range(num_stages=...)`:
    cp.async into shared memory), so several tiles per program are in flight;
  * the product is accumulated in fp32: for M <= FMA_MAX_M by broadcast-multiply on CUDA cores
    (M padded to a power of two; with M = 1 the sum over K is deferred to the end of the loop),
    for larger M by `tl.dot` on tensor cores with M padded to 16 (the padding is free: the
    kernel is bound by the weight bytes, not by math);
  * split-K without a second launch: when N / BLOCK_N programs cannot fill the GPU, K is split.
    Each program stores its fp32 partial into a workspace and increments a per-tile counter
    (release/acquire atomics); the program that sees it was the last one sums the partials in
    split order (so the result is deterministic), adds the bias, writes the output, and resets
    the counter to 0. The counters live in a small persistent int32 buffer per device, zeroed
    once, which is therefore zero again after every call and every CUDA-graph replay.

`linear` is a drop-in for F.linear that takes this path only where the kernel is expected to win
(few rows, weight size in a tuned range; see the module constants, tuned with
benchmarks/gemv.py) and falls back to F.linear everywhere else, including without Triton.
Everything is CUDA-graph capturable: no host syncs, fixed-size allocations only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels import fused
from nanoserve.kernels._triton import HAS_TRITON, cdiv, jit, next_power_of_2, num_sms, prev_power_of_2, tl

MAX_M = 16  # rows handled by the kernel; more rows are a GEMM, left to cuBLAS
FMA_MAX_M = 4  # rows up to this use CUDA-core multiply-add; more rows use tl.dot
MIN_WEIGHT_BYTES = 0  # `linear` uses the kernel for weights of MIN..MAX bytes (benchmarks/gemv.py)
MAX_WEIGHT_BYTES = 160 * 2**20  # larger weights: cuBLAS already streams them at copy bandwidth
MAX_SPLIT_K = 16
COUNTER_SLOTS = 8192  # output tiles that can be split-K'd in one call (one int32 counter each)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """One kernel variant. split_k is derived from programs_per_sm unless given explicitly."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    programs_per_sm: float = 2.0  # split K until the grid has about this many programs per SM; 0: never
    split_k: int | None = None

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"tl.dot needs block_n and block_k >= 16, got {self.block_n}, {self.block_k}")
        if self.num_stages < 1 or (self.split_k is not None and self.split_k < 1):
            raise ValueError(f"num_stages and split_k must be >= 1, got {self.num_stages}, {self.split_k}")

    def short(self) -> str:
        """A compact name for tables: path, tile, warps, stages and the split rule."""
        split = f"s{self.split_k}" if self.split_k is not None else f"p{self.programs_per_sm:g}"
        kind = "dot" if self.use_dot else "fma"
        return f"{kind} {self.block_n}x{self.block_k} w{self.num_warps} st{self.num_stages} {split}"


# Variants and where they win, from benchmarks/results/gemv_h200.json (H200, graph-timed, cold weights):
# one row: the kernel beats cuBLAS on every decode matrix up to ~160 MB (Qwen3-0.6B o_proj 3.5 vs 12.8 µs,
# down 4.1 vs 7.4; Llama-3.1-8B o_proj 10.7 vs 13.4, down 28.7 vs 31.3, qkv 14.8 vs 15.7) and ties above;
# two rows: only small matrices (< 8 MB) win; from four rows on cuBLAS is as fast, so it keeps them.
FMA_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3, programs_per_sm=0)
FMA_SMALL_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, programs_per_sm=0)
DOT_CONFIG = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, use_dot=True, programs_per_sm=1)
SMALL_WEIGHT_BYTES = 8 * 2**20
MAX_AUTO_M = 2  # rows for which `linear` picks the kernel on its own (force_triton/config reach MAX_M)


@dataclass(frozen=True)
class LaunchPlan:
    """A config resolved for one (M, N, K): the exact launch."""

    block_m: int
    block_n: int
    block_k: int
    n_tiles: int  # cdiv(N, block_n)
    split_k: int
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int
    use_dot: bool
    reduce_chunk: int  # partials the last program loads at once

    @property
    def grid(self) -> tuple[int, int]:
        return (self.n_tiles, self.split_k)


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The variant for a shape: multiply-add on CUDA cores for few rows (narrow tiles for small matrices),
    tensor cores beyond."""
    if m > FMA_MAX_M:
        return DOT_CONFIG
    return FMA_SMALL_CONFIG if n * k * 2 <= SMALL_WEIGHT_BYTES else FMA_CONFIG


def auto_applies(m: int, n: int, k: int, element_size: int) -> bool:
    """Where the measurements say the kernel beats cuBLAS (see the variants above)."""
    weight_bytes = n * k * element_size
    if m == 1:
        return MIN_WEIGHT_BYTES <= weight_bytes <= MAX_WEIGHT_BYTES
    return m <= MAX_AUTO_M and weight_bytes <= SMALL_WEIGHT_BYTES


def plan(config: GemvConfig, m: int, n: int, k: int, sms: int) -> LaunchPlan:
    """Resolve block sizes and the K split for one shape (pure; unit-tested)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the gemv kernel handles 1..{MAX_M} rows, got {m}")
    block_m = max(16, next_power_of_2(m)) if config.use_dot else next_power_of_2(m)
    floor_k = 16 if config.use_dot else 1
    block_k = max(floor_k, min(config.block_k, next_power_of_2(k)))
    k_blocks = cdiv(k, block_k)
    tiles = cdiv(n, config.block_n)
    if config.split_k is not None:
        split = config.split_k
    elif config.programs_per_sm > 0:
        split = cdiv(math.ceil(config.programs_per_sm * sms), tiles)
    else:
        split = 1
    split = max(1, min(split, k_blocks, MAX_SPLIT_K))
    if tiles > COUNTER_SLOTS:
        split = 1
    k_per_split = cdiv(k_blocks, split) * block_k
    split = cdiv(k, k_per_split)  # no empty slices
    # The last program of a tile sums [reduce_chunk, block_n, block_m] partials per load round.
    reduce_chunk = max(1, min(8, prev_power_of_2(2048 // (config.block_n * block_m))))
    return LaunchPlan(block_m=block_m, block_n=config.block_n, block_k=block_k, n_tiles=tiles, split_k=split,
                      k_per_split=k_per_split, num_warps=config.num_warps, num_stages=config.num_stages,
                      use_dot=config.use_dot, reduce_chunk=reduce_chunk)


# -- persistent split-K counters -------------------------------------------------------------------
_counters: dict[torch.device, torch.Tensor] = {}


def _counters_for(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counter buffer; None while a CUDA graph is being captured and the buffer
    does not exist yet (it must not come from the graph's private pool, which dies with the graph)."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


# -- entry points ------------------------------------------------------------------------------------
def kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes the Triton path for these arguments (see the module constants)."""
    if not HAS_TRITON or not x.is_cuda or x.dim() != 2 or weight.dim() != 2:
        return False
    m, k = x.shape
    n = weight.shape[0]
    if not (1 <= m <= MAX_M) or x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype:
        return False
    if weight.shape[1] != k or k % 16 or not weight.is_contiguous() or weight.device != x.device:
        return False
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return False  # the kernel has no backward
    return auto_applies(m, n, k, weight.element_size())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           force_triton: bool = False, config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); the one-launch Triton kernel where it wins (or with force_triton,
    on any device — CPU runs go through TRITON_INTERPRET=1). config overrides the default variant."""
    if not (force_triton or kernel_applies(x, weight, bias)):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias, x.shape[1], config)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, *, force_triton: bool = False):
    """(rms_norm(x + residual) · norm_weight) @ weight.T + bias, and the new residual x + residual.

    For one row (batch-1 decode) the norm runs inside the GEMV's prologue: one kernel instead of two.
    Without a residual (the first layer) the new residual is x itself."""
    if not (force_triton or (kernel_applies(x, weight, bias) and x.shape[0] == 1)):
        if residual is None:
            return linear(fused.rms_norm(x, norm_weight, eps), weight, bias), x
        normed, residual = fused.rms_norm(x, norm_weight, eps, residual)
        return linear(normed, weight, bias), residual
    new_residual = torch.empty_like(x) if residual is not None else x
    out = _launch(x, weight, bias, x.shape[1], None, prologue=_NORM, residual=residual,
                  residual_out=new_residual, norm_weight=norm_weight, eps=eps)
    return out, new_residual


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    force_triton: bool = False) -> torch.Tensor:
    """(silu(gate) · up) @ weight.T + bias for gate_up = [gate | up]; one kernel for one row."""
    k = gate_up.shape[1] // 2
    one_row = gate_up.shape[0] == 1 and gate_up.stride(1) == 1
    if not (force_triton or (one_row and kernel_applies(gate_up[:, :k], weight, bias))):
        return linear(fused.silu_and_mul(gate_up), weight, bias)
    return _launch(gate_up, weight, bias, k, None, prologue=_SILU_MUL)


_PLAIN, _NORM, _SILU_MUL = 0, 1, 2  # what the kernel does to x as it loads it


def _launch(x, weight, bias, k, config, prologue=_PLAIN, residual=None, residual_out=None, norm_weight=None,
            eps=0.0) -> torch.Tensor:
    if not HAS_TRITON:
        raise RuntimeError("the Triton GEMV was requested but triton is not installed")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n = x.shape[0], weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if prologue != _PLAIN and m != 1:
        raise ValueError(f"the fused norm / SiLU prologue handles one row, got {m}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    cfg = config or default_config(m, n, k)
    if prologue != _PLAIN:  # each program must see the whole row for the norm: never split K
        cfg = GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.use_dot, split_k=1)
    p = plan(cfg, m, n, k, num_sms(x.device))
    counters = _counters_for(x.device) if p.split_k > 1 else None
    if p.split_k > 1 and counters is None:  # first use inside a capture: take the unsplit variant
        p = plan(GemvConfig(p.block_n, p.block_k, p.num_warps, p.num_stages, p.use_dot, split_k=1), m, n, k, 1)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if p.split_k > 1:
        partials = torch.empty(p.split_k, m, n, dtype=torch.float32, device=x.device)
    else:  # never touched; placeholders of the same dtypes let both kinds of launch share one compiled kernel
        partials = torch.empty(1, dtype=torch.float32, device=x.device)
        counters = torch.empty(1, dtype=torch.int32, device=x.device)
    _gemv_kernel[p.grid](
        x, weight, bias if bias is not None else out, out, partials, counters,
        residual if residual is not None else x, residual_out if residual_out is not None else x,
        norm_weight if norm_weight is not None else x, eps,
        m, n, k, x.stride(0), out.stride(0), p.k_per_split,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, USE_DOT=p.use_dot,
        EVEN_K=k % p.block_k == 0, HAS_BIAS=bias is not None, REDUCE_CHUNK=p.reduce_chunk,
        LOOP_STAGES=p.num_stages, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=not x.is_cuda,  # the interpreter (CPU tensors) multiplies bf16 bit patterns as integers
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        num_warps=p.num_warps, num_stages=p.num_stages)
    return out


@jit
def _write_output(acc, bias_ptr, out_ptr, offs_n, offs_m, N, stride_om, mask, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] fp32 (+ bias in fp32) → out[m, n], rounded once."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@jit
def _residual_sum(x_ptr, res_ptr, cols, K, HAS_RESIDUAL: tl.constexpr):
    """x + residual for one row, rounded to the model dtype like HF's add, as fp32."""
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                 res_ptr, res_out_ptr, norm_w_ptr, eps,
                 M, N, K, stride_xm, stride_om, k_per_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 REDUCE_CHUNK: tl.constexpr, LOOP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N wrap around so weight loads need no mask (those outputs are never stored).
    w_rows = w_ptr + (offs_n % N).to(tl.int64)[:, None] * K
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # the [BLOCK_M, BLOCK_K] x tile of the dot path
    m_mask = offs_m[:, None] < M
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)

    inv_rms = 0.0
    if PROLOGUE == 1:  # RMSNorm prologue (one row, K unsplit): every program first takes the row's norm
        sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            h = _residual_sum(x_ptr, res_ptr, k + offs_k, K, HAS_RESIDUAL)
            sum_sq += h * h
        inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # M = 1: reduce over K once, at the end
    for k in tl.range(k_start, k_stop, BLOCK_K, num_stages=LOOP_STAGES):
        cols = k + offs_k[None, :]
        if EVEN_K:
            w = tl.load(w_rows + cols)
        else:
            w = tl.load(w_rows + cols, mask=cols < K, other=0.0)
        if USE_DOT:
            x = tl.load(x_rows + cols, mask=m_mask & (cols < K), other=0.0)
            if DOT_IN_FP32:  # same products: bf16 x bf16 is exact in fp32
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        elif BLOCK_M == 1:
            if PROLOGUE == 1:  # x = norm_w · round(h · inv_rms), rounded like the separate RMSNorm kernel
                h = _residual_sum(x_ptr, res_ptr, cols, K, HAS_RESIDUAL)
                if HAS_RESIDUAL:
                    if pid_n == 0:  # one program writes the new residual stream
                        tl.store(res_out_ptr + cols, h.to(res_out_ptr.dtype.element_ty), mask=cols < K)
                dtype = out_ptr.dtype.element_ty
                nw = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                xf = (nw * (h * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            elif PROLOGUE == 2:  # x = silu(gate) · up from the [gate | up] row, rounded once
                gate = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + K + cols, mask=cols < K, other=0.0).to(tl.float32)
                xf = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty).to(tl.float32)
            else:
                xf = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc_wide += w.to(tl.float32) * xf
        else:  # one row of x at a time keeps the live registers at one [BLOCK_N, BLOCK_K] product
            wf = w.to(tl.float32)
            for i in tl.static_range(BLOCK_M):  # rows past M repeat row M - 1 and are never stored
                xi = tl.load(x_ptr + tl.minimum(i, M - 1) * stride_xm + cols, mask=cols < K, other=0.0)
                row = tl.sum(wf * xi.to(tl.float32), axis=1)
                acc += tl.where(offs_m[None, :] == i, row[:, None], 0.0)
    if not USE_DOT and BLOCK_M == 1:
        acc = tl.sum(acc_wide, axis=1)[:, None]

    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if num_splits == 1:
        _write_output(acc, bias_ptr, out_ptr, offs_n, offs_m, N, stride_om, out_mask, HAS_BIAS)
    else:
        tile = offs_m[None, :] * N + offs_n[:, None]  # partials are [split, M, N] fp32
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # all threads' partials are written before the (thread-0) release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # last program of this tile: reduce in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            offs_s = tl.arange(0, REDUCE_CHUNK)
            for s0 in range(0, num_splits, REDUCE_CHUNK):
                s = s0 + offs_s
                parts = tl.load(partial_ptr + s[:, None, None] * (M * N) + tile[None, :, :],
                                mask=(s < num_splits)[:, None, None] & out_mask[None, :, :], other=0.0,
                                cache_modifier=".cg")  # from L2: other SMs wrote them
                total += tl.sum(parts, axis=0)
            _write_output(total, bias_ptr, out_ptr, offs_n, offs_m, N, stride_om, out_mask, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call / graph replay
