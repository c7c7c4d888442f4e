"""The grouped GEMM of the MoE prefill path: rows sorted by expert into blocks of BLOCK_M, each block multiplied by its
expert's weight (moe.py sorts the rows: align_blocks; this file only multiplies).

One kernel serves both projections:
  * GEMM1 (GATED): A row = x[pair // top_k], and each program computes a gate tile (w13 rows n0..n0+BN) and the
    matching up tile (rows I+n0..) with two accumulators, so SiLU·mul is its epilogue and inter [pairs, I] is
    written once, never the [pairs, 2I] product;
  * GEMM2 (WEIGHTED): A row = inter[pair], the pair's routing weight scales the fp32 result before it is stored to
    out_pairs[pair] (the caller sums a token's k rows: a fixed order, no atomics, so replays equal eager runs).
The grid is fixed by shapes (the padded bound of align_blocks, for CUDA graphs); programs past the real block
count (num_padded, on the device) exit at once. Programs are ordered in groups of GROUP_M row blocks per column
tile, so blocks of the same expert that run together read its weight tile from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kernels._triton import cdiv, jit, next_power_of_2, pdl_args, pdl_start, pdl_wait, tl

# The tilings by pairs per expert, measured on the H200 (benchmarks/moe_tiles.py, Qwen3-30B-A3B's layer shape; results
# in benchmarks/results/moe_tiles_*.json): up to 16 pairs an expert, 16-row blocks (less padding, the product reads
# each selected expert's weights once, at the bandwidth floor); from LARGE_BLOCK_M_MIN_PAIRS, 128-row blocks with
# 8 warps (an 8192-token prefill step: 14% faster than 64-row blocks).
SMALL_BLOCK_M_MAX_PAIRS = 16
LARGE_BLOCK_M_MIN_PAIRS = 256


@dataclass(frozen=True)
class GroupedTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def grouped_tiles(pairs_per_expert: float, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GroupedTiles:
    """The tiling of one grouped product with n output columns and k reduced ones. block_m depends on
    pairs_per_expert only, so the two products of a call share it (and the one align_blocks). Small row blocks
    waste less padding when experts get few rows; large ones reuse each weight tile over more rows. fp32 halves
    block_k (the same bytes per pipeline stage). In the interpreter (CPU) small tiles keep the tests quick."""
    if device.type != "cuda":
        return GroupedTiles(8 if pairs_per_expert <= 8 else 16, 32, 32, num_warps=4, num_stages=1, group_m=2)
    if pairs_per_expert <= SMALL_BLOCK_M_MAX_PAIRS:
        block_m, block_n, block_k, num_warps, num_stages = 16, 64, 128, 4, 4
    elif pairs_per_expert < LARGE_BLOCK_M_MIN_PAIRS:
        block_m, block_n, block_k, num_warps, num_stages = 64, 64, 64, 4, 3
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 128, 64, 8, 3
    if dtype.itemsize >= 4:
        block_k //= 2
    return GroupedTiles(block_m, min(block_n, max(16, next_power_of_2(n))), min(block_k, max(16, next_power_of_2(k))),
                        num_warps, num_stages)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, topk_weights: torch.Tensor, top_k: int,
                 gated: bool, tiles: GroupedTiles) -> torch.Tensor:
    """out[pair] = epilogue(a[pair // top_k if gated else pair] @ w[expert].T) for every pair in sorted_pairs; see
    the module docstring. a [rows, K], w [E, N or 2N, K] (unit last stride), out [pairs, N]."""
    num_pairs, n = out.shape
    k = a.shape[1]
    num_blocks = block_expert.shape[0]
    grid = (num_blocks * cdiv(n, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, num_padded, topk_weights, num_pairs, num_blocks, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=top_k if gated else 1, GATED=gated, WEIGHTED=not gated,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        EVEN_K=k % tiles.block_k == 0, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=not a.is_cuda,  # the interpreter (CPU tensors) multiplies bf16 bit patterns as integers
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(a.device))
    return out


@jit
def _dot(a, b, acc, PRECISION: tl.constexpr, IN_FP32: tl.constexpr):
    if IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
                         num_pairs, num_blocks, N, K, stride_am, stride_we, stride_wn, stride_om,
                         A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)  # everything below depends on align_blocks (and GEMM1's inter), even which weights to read
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_size = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + pid % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # the rest are padding (the sentinel num_pairs)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    up_step = N * stride_wn  # GEMM1: the up rows sit N = I rows below the gate rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = valid[:, None]
            w_mask = n_mask[None, :]
        else:
            a_mask = valid[:, None] & (offs_k[None, :] < K - k)
            w_mask = n_mask[None, :] & (offs_k[:, None] < K - k)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc = _dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, DOT_PRECISION, DOT_IN_FP32)
        if GATED:
            acc_up = _dot(a, tl.load(w_ptrs + up_step, mask=w_mask, other=0.0), acc_up, DOT_PRECISION, DOT_IN_FP32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
