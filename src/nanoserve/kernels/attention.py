"""Paged attention: the backend selection point, and the Triton kernels (KV store, split-K decode, paged prefill).

Two backends with one contract: "torch" (reference.py; the CPU path and the oracle these kernels are
tested against) and "triton" (this file; CUDA). The backend is chosen once per model (select_backend),
never per call; paged_attention dispatches on it. Caches are [num_blocks, block_size, num_kv_heads,
head_dim]; a token's slot is block_id * block_size + offset.

Decode is flash-decoding: grid (seq, kv_head, split). One program handles every query head of
its kv head (rows of a tl.dot, padded to 16) so K/V are read once per kv head, and walks one
partition of the context. The number of splits comes only from static shapes (batch, heads,
block-table width, SM count), never from context_lens values, so decode has no host sync and
can be captured in a CUDA graph; partitions past a sequence's context exit at once, and a
second kernel merges the partial (max, sum, acc) of the splits that ran. Over an fp8 cache, small GQA groups at
moderate batch take _decode_lanes_kernel instead (same grid and partials, products on the CUDA cores: an 8-bit tile
reaches the tensor cores only through shared memory and per-element widening).

Sliding window and logit soft-cap (reference.py says what they mean) are per-call values of one compiled kernel:
the window a runtime int (NO_WINDOW: none), the softcap a SOFTCAP constexpr branch with runtime scales, so every
layer of a model shares the kernels and a captured graph records each layer's values. Decode partitions cover only
the window's keys; a prefill tile starts at its first token's window; blocks that slid out are never read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.kernels import attention_sm90, kv_quant, reference
from nanoserve.kernels._triton import (cdiv, jit, next_power_of_2, num_sms, pdl_args, pdl_start, pdl_wait, tl,
                                       use_triton)
from nanoserve.kernels.decode_split import decode_partition, tail_split
from nanoserve.kernels.kv_quant import quantize_rows, tail_row_tl
from nanoserve.kernels.metadata import AttentionInputs
from nanoserve.kernels.paging import require_cache_layout
from nanoserve.kernels.switches import SWITCHES


def select_backend(device: torch.device) -> str:
    return "triton" if use_triton(device) else "torch"


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionInputs, scale: float, backend: str,
                    kv_stored: bool = False, *, window: int | None = None,
                    softcap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the T new tokens → attention output [T, H, D].

    kv_stored: the caller already wrote k/v into the cache (fused into its rotary kernel); k and v may then be
    None (not with a tail: a prompt step reads its own tokens' exact values from them). window / softcap: the
    layer's sliding window and logit soft-cap (reference.py says what they mean; None: off), fixed per layer, so a
    captured graph records them. kv_scales: (k_scale, v_scale) of an fp8 cache (kernels/kv_quant.py); None for a
    cache in the model's dtype. kv_tail: an fp8 cache's tail (kv_quant.TAIL_BANKS; written at meta.tail_rows, read
    at each sequence's slot, meta.table_rows)."""
    if backend == "triton":
        store, prefill, decode = store_kv, prefill_attention, decode_attention
    else:
        store, prefill, decode = reference.store_kv, reference.prefill_attention, reference.decode_attention
    if not kv_stored:
        store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales, kv_tail, meta.tail_rows)
    if meta.is_prefill:
        return prefill(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap, kv_scales=kv_scales,
                       kv_tail=kv_tail)
    return decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window=window, softcap=softcap,
                  kv_scales=kv_scales, kv_tail=kv_tail, slots=meta.table_rows, seq_rows=meta.seq_rows,
                  group_back=meta.group_back)


def check_window_softcap(window: int | None, softcap: float | None) -> None:
    """A sliding window is a positive key count and a soft-cap a positive bound (or None: off)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention logit softcap must be positive or None, got {softcap!r}")


_LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the kernels' window argument for "no sliding window": more keys than any context holds

# Decode splits: each covers at least MIN_PARTITION tokens (less is not worth its partials), and the
# grid aims for WAVES programs per SM so that small batches still fill the GPU.
DECODE_MIN_PARTITION = 64  # tokens; with per-sequence partitions short contexts still spread over the splits
# Splits aim for DECODE_WAVES programs per SM once the (sequence, kv head) grid alone fills the SMs (more splits then
# only add partials and merge traffic: b=64 Qwen3-30B-A3B 24.2 µs a layer at 2 splits vs 30.4 at 3; b=64 Llama-3.1-8B
# and every b=256 best unsplit; the engine's 81-row graph of Qwen3-30B-A3B 26.1 µs at 2 splits, 26.6 at 1), for
# DECODE_WAVES_SPARSE while it does not (b=8 Llama-3.1-8B 11.2 µs at 33 splits vs 13.9 at 9):
# benchmarks/results/attention_waves_*_h200.json, experiments/moe_qwen3_prefetch_down_*.json.
DECODE_WAVES = 3
DECODE_WAVES_SPARSE = 16
DECODE_MAX_SPLITS = 128
DECODE_NUM_WARPS = 4
# Query rows (a verifying sequence's rows × its GQA heads) one decode program takes at most: a longer group is read in
# chunks of rows, each chunk's keys once.
DECODE_GROUP_TILE = 32
DECODE_NUM_STAGES = 3  # software-pipeline depth of the key-tile loop (Triton's default on sm_90)
# An fp8 cache's tiles are widened in registers: pipelining them through shared memory makes the kernel slower (Qwen3-0.6B
# b=256 with 128-key tiles: 112.6 µs a layer at 1 stage, 132.2 at 2, 139.2 at 3; 8 warps slower too:
# benchmarks/results/experiments/fp8_decode_sweep_*_h200.json).
DECODE_NUM_STAGES_FP8 = 1
# K/V tiles of at most this many bytes (64 tokens of bf16 at head_dim 128): larger ones spill registers.
KV_TILE_BYTES = 16384
MAX_BLOCK_N = 64
# The decode kernel's key tile over an fp8 cache is as many bytes as bf16's (KV_TILE_BYTES, 128 keys at head_dim 128):
# Qwen3-0.6B b=256 112.6 µs a layer against 151.6 with 64-key tiles (bf16 KV: 129.2; fp8_decode_sweep_*_h200.json).
MAX_BLOCK_N_FP8 = 128
# An fp8 cache's plain decode (one query row per sequence) runs on the CUDA cores (_decode_lanes_kernel) for GQA groups
# of at most DECODE_LANES_MAX_GROUP heads while the (sequence, kv head) programs are at most DECODE_LANES_MAX_WAVES
# per SM, in tiles of rows x DECODE_LANES keys (LANES softmaxes a program) with DECODE_LANES_WARPS warps:
# DECODE_LANES_ROWS rows once the programs fill the SMs, else DECODE_LANES_ROWS_SPARSE. H100, Qwen3-0.6B's heads,
# 512-token contexts, µs a layer read with the engine's exact tail, CUDA-core vs tensor-core kernel: b=64 34.6 vs
# 36.0, b=256 131.1 vs 127.6 (without the tail 125.2 vs 145.9: the tail makes the tensor-core kernel faster); b=1
# 7.5 vs 8.5 without the tail. 4 heads (Llama-3.1-8B) lose (b=256 196.7 vs 147.5 without the tail: 255 registers),
# 8 spill; 8 warps, 1-row tiles and a register prefetch of the next tile lose
# (benchmarks/results/experiments/fp8_decode_lanes_*_h100.json).
DECODE_LANES = 16
DECODE_LANES_ROWS = 2
DECODE_LANES_ROWS_SPARSE = 4
DECODE_LANES_WARPS = 4
DECODE_LANES_MAX_GROUP = 2
DECODE_LANES_MAX_WAVES = 8
# A tensor-core fp8 decode of at most DECODE_FP8_FEW_PROGRAMS (sequence, kv head) programs (b = 1 at 8 kv heads) reads
# 64-key tiles with 8 warps: Llama-3.1-8B's heads, 512 / 2048-token contexts, µs a layer with the tail (H100): 7.2 / 8.1
# against 8.9 / 11.5 at 128 keys and 4 warps; at b = 8 (64 programs) 8 warps lose (15.2 vs 12.9;
# benchmarks/results/experiments/fp8_decode_few_programs_234a762_h100.json). It takes them before the Gluon kernel and
# the CUDA-core one: b = 1 steps over 32-token blocks with V transposed (H100, ms): Qwen3-0.6B 0.919 against 0.984
# (Gluon) and 1.533 (CUDA cores; bf16 KV 0.877-0.887), Llama-3.1-8B 5.218 against 5.419 (Gluon; bf16 KV 5.201-5.321)
# (benchmarks/results/experiments/kv_cache_b1_few_programs_ahead_a23032f_h100.json, kv_cache_gluon_a23032f_h100.json).
DECODE_FP8_FEW_PROGRAMS = 8
DECODE_FP8_FEW_BLOCK_N = 64
DECODE_FP8_FEW_WARPS = 8
PREFILL_NUM_STAGES = 3  # Triton's default on sm_90
PREFILL_NUM_STAGES_FP8 = 1  # as decode's: an fp8 cache's tiles are widened in registers, not pipelined


@jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST (CPU interpreter only) multiplies in fp32, because the
    interpreter multiplies bf16 tiles as their raw uint16 bits; callers round to the tile dtype first."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


# --------------------------------------------------------------------------------------------- store


@jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ks_ptr, vs_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_b, stride_kc_t, stride_kc_h, stride_kc_d, stride_vc_b, stride_vc_t, stride_vc_h,
                     stride_vc_d, stride_s_slot, stride_s_h,
                     k_tail_ptr, v_tail_ptr, tail_rows_ptr, stride_tail_row, stride_tail_h,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, TOKEN_SCALES: tl.constexpr,
                     USE_PDL: tl.constexpr, TAIL: tl.constexpr = False):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    src = token.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + src * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if TAIL:  # the token's exact copy, before quantization (kv_quant.TAIL_BANKS); row -1: none
        row = tl.load(tail_rows_ptr + token).to(tl.int64)
        rows = tl.zeros([BLOCK_H], tl.int64) + row
        tail_at = rows[:, None] * stride_tail_row + heads[:, None] * stride_tail_h + dims[None, :]
        tail_mask = mask & (rows[:, None] >= 0)
        tl.store(k_tail_ptr + tail_at, k.to(k_tail_ptr.dtype.element_ty), mask=tail_mask)
        tl.store(v_tail_ptr + tail_at, v.to(v_tail_ptr.dtype.element_ty), mask=tail_mask)
    if FP8:
        scale_at = slot * stride_s_slot + heads[:, None] * stride_s_h
        head_ok = heads[:, None] < NUM_KV_HEADS
        k = quantize_rows(k, ks_ptr + scale_at, head_ok, TOKEN_SCALES)
        v = quantize_rows(v, vs_ptr + scale_at, head_ok, TOKEN_SCALES)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE  # (a cache's V may be stored transposed in its blocks)
    tl.store(k_cache_ptr + block * stride_kc_b + offset * stride_kc_t + heads[:, None] * stride_kc_h
             + dims[None, :] * stride_kc_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vc_b + offset * stride_vc_t + heads[:, None] * stride_vc_h
             + dims[None, :] * stride_vc_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None, tail_rows: torch.Tensor | None = None) -> None:
    """Write k/v [num_tokens, num_kv_heads, head_dim] into their cache slots: one launch, no sync. An fp8 cache
    (kv_scales given) stores e4m3 codes, and per-token scales beside them (kernels/kv_quant.py); with its tail
    (kv_tail), each token whose tail_rows entry is >= 0 is also written there, in the tail's dtype."""
    num_tokens = k.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if k.shape != v.shape or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"store_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not match cache heads "
                         f"({num_kv_heads}, {head_dim})")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"store_kv: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")
    scales, fmt = kv_quant.kernel_args(k_cache, kv_scales)
    if num_tokens == 0:
        return
    _require_unit_last_stride(store_kv=(k, v))
    require_cache_layout("store_kv", k_cache, v_cache, kv_scales if fmt["TOKEN_SCALES"] else None)
    if kv_tail is not None and (tail_rows is None or tail_rows.shape != (num_tokens,)):
        raise ValueError(f"store_kv: a tail needs tail_rows [{num_tokens}]")
    tail = _tail_args(kv_tail, k_cache, fmt, tail_rows, "store_kv")
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](k, v, k_cache, v_cache, slot_mapping, scales[0], scales[1],
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           *k_cache.stride(), *v_cache.stride(), scales[3], scales[4], *tail,
                           NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
                           BLOCK_H=block_h, BLOCK_D=block_d, **fmt, num_warps=4, **pdl_args(k.device),
                           TAIL=kv_tail is not None)


# --------------------------------------------------------------------------------------------- decode


@jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, begin, end, first_key, last_key, kv_head,
                 dims, dim_ok, qk_scale, cap_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_vd, ks_ptr, vs_ptr, stride_sb, stride_st, stride_sh,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, MASKED: tl.constexpr = True):
    """Fold keys [start, start + BLOCK_N) ∩ [begin, end) of one paged context into the running (max, sum, acc) of
    the rows of q (log2-domain online softmax); row r attends only to keys in [first_key[r], last_key[r]] (its
    sliding window); keys outside [begin, end) are not even loaded, nor their block-table entries. A row may see
    no key of a tile (its window starts later): its running max then stays -inf and the tile adds nothing.
    MASKED=False: the caller knows every row sees every key of the tile (below the causal diagonal, inside every
    row's window), so neither the loads nor the scores are masked. FP8: the cache holds e4m3 codes, widened to q's
    dtype in registers; a key's scale multiplies its scores and its value's probabilities (kernels/kv_quant.py)."""
    keys = tl.multiple_of(start, BLOCK_N) + tl.arange(0, BLOCK_N)  # every tile starts on a tile boundary
    offsets = keys % BLOCK_SIZE
    if MASKED:
        key_ok = (keys >= begin) & (keys < end)
        block_ids = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
    else:
        block_ids = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
        kv_mask = dim_ok[None, :]
    k = tl.load(k_cache_ptr + block_ids[:, None] * stride_kb + offsets[:, None] * stride_kt
                + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
    dots = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, DOT_UPCAST)
    if FP8:
        scale_at = block_ids * stride_sb + offsets * stride_st + kv_head * stride_sh
        if MASKED:
            dots = dots * tl.load(ks_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)[None, :]
            v_scale = tl.load(vs_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)
        else:
            dots = dots * tl.load(ks_ptr + scale_at).to(tl.float32)[None, :]
            v_scale = tl.load(vs_ptr + scale_at).to(tl.float32)
    scores = _scores(dots, qk_scale, cap_scale, SOFTCAP)
    if MASKED:
        seen = key_ok[None, :] & (keys[None, :] >= first_key[:, None]) & (keys[None, :] <= last_key[:, None])
        scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp2(-inf - 0) = 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        p = p * v_scale[None, :]
    if FP8 and (BLOCK_N % BLOCK_SIZE == 0) and ((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0):
        v = _block_tile(v_cache_ptr, table, start, begin, end, kv_head, dims, dim_ok, stride_vb, stride_vt,
                        stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, MASKED)
    else:  # bf16, or an fp8 tile that does not hold whole blocks
        v = tl.load(v_cache_ptr + block_ids[:, None] * stride_vb + offsets[:, None] * stride_vt
                    + kv_head * stride_vh + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


@jit
def _block_tile(v_cache_ptr, table, start, begin, end, kv_head, dims, dim_ok, stride_vb, stride_vt, stride_vh,
                stride_vd, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """An fp8 cache's V tile [BLOCK_N, dims] of keys [start, start + BLOCK_N), loaded as [blocks, block_size, dims]
    with one mask per block (whole blocks; keys outside [begin, end) zeroed after the load), so the loads stay
    vectorized along each block's run of keys. (Loading it, or K too, with K before the scores was slower:
    benchmarks/results/experiments/fp8_decode_variants_*_h200.json.)"""
    NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
    first = start // BLOCK_SIZE + tl.arange(0, NB)
    offsets = tl.arange(0, BLOCK_SIZE)
    keys = first[:, None] * BLOCK_SIZE + offsets[None, :]
    ptrs_at = offsets[None, :, None] * stride_vt + kv_head * stride_vh + dims[None, None, :] * stride_vd
    if MASKED:  # keys outside [begin, end) are zeroed after the load: their slots may hold anything, NaN included
        key_ok = (keys >= begin) & (keys < end)
        block_ok = (first * BLOCK_SIZE < end) & (first * BLOCK_SIZE + BLOCK_SIZE > begin)
        block_ids = tl.load(table + first, mask=block_ok, other=0).to(tl.int64)
        v = tl.load(v_cache_ptr + block_ids[:, None, None] * stride_vb + ptrs_at,
                    mask=block_ok[:, None, None] & dim_ok[None, None, :], other=0.0)
        v = tl.where(key_ok[:, :, None], v, 0.0)
    else:
        block_ids = tl.load(table + first).to(tl.int64)
        v = tl.load(v_cache_ptr + block_ids[:, None, None] * stride_vb + ptrs_at, mask=dim_ok[None, None, :],
                    other=0.0)
    return tl.reshape(v, [BLOCK_N, v.shape[2]])


@jit
def _product_q(q, k_cache_ptr, FP8: tl.constexpr, Q_FP16: tl.constexpr):
    """q in the dtype the products multiply in (_compute_dtype): the cache's; over an fp8 cache, fp16 for a 16-bit q
    (e4m3 widens to fp16 in one conversion per two values, to bf16 through fp16; fp16 also keeps more of q's
    mantissa; clamped to fp16's range) and q's own dtype otherwise."""
    if not FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif Q_FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@jit
def _scores(dots, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """q·k dot products → log2-domain logits (_score_args gives the scales). With SOFTCAP they are
    softcap * tanh(x) * log2(e) for x = scale * dot / softcap, as tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates
    to ±1 without overflow: qk_scale turns dots into 2x in the log2 domain, cap_scale is softcap * log2(e)."""
    if SOFTCAP:
        return cap_scale * (1.0 - 2.0 / (tl.exp2(dots * qk_scale) + 1.0))
    return dots * qk_scale


@jit
def _attend_exact(q, m_i, l_i, acc, k, v, seen, qk_scale, cap_scale, DOT_PRECISION: tl.constexpr,
                  DOT_UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold exact keys k / values v [BLOCK_T, dims] (in q's dtype, zero where not loaded) into the running (max, sum,
    acc) of the rows of q, row r seeing key t where seen[r, t]: the tail's part of _attend_tile (no scales, products
    in the model's dtype)."""
    scores = _scores(_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST), qk_scale, cap_scale, SOFTCAP)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


@jit
def _row_group(group_back_ptr, row, num_rows, SEQ_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    """(first, last) row of `row`'s group: a sequence verifying drafts runs as consecutive rows, group_back[r] of
    them before row r (at most SEQ_ROWS in all, which the runner checks); plain and padding rows have 0 and are
    groups of one. Only loads that depend on nothing but `row`: they go out together with the context length's."""
    if SEQ_ROWS == 1:  # (one return: Triton compiles the code after an early one too)
        first = row
        last = row
    else:
        back = tl.load(group_back_ptr + row)
        d = tl.arange(0, BLOCK_R)
        after = row + 1 + d
        ok = (d < SEQ_ROWS - 1) & (after < num_rows)
        member = ok & (tl.load(group_back_ptr + after, mask=ok, other=-1) == back + 1 + d)
        first = row - back
        last = row + tl.min(tl.where(member, BLOCK_R, d), 0)  # the run of rows that continue the group
    return first, last


@jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                   part_acc_ptr, part_ml_ptr, qk_scale, cap_scale, window, num_splits,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_bt,
                   ks_ptr, vs_ptr, stride_sb, stride_st, stride_sh,
                   k_tail_ptr, v_tail_ptr, slots_ptr, stride_tail_row, stride_tail_h, group_back_ptr,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                   DOT_UPCAST: tl.constexpr, FP8: tl.constexpr, Q_FP16: tl.constexpr, USE_PDL: tl.constexpr,
                   TAIL: tl.constexpr = False, BLOCK_T: tl.constexpr = 16, SEQ_ROWS: tl.constexpr = 1,
                   BLOCK_R: tl.constexpr = 1, CHUNK_ROWS: tl.constexpr = 1):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)  # q, the cache and the decode inputs all come from earlier kernels
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # A group's rows in chunks of CHUNK_ROWS from its last: each chunk's last row (the longest context, the fullest
    # table) reads the keys once for every row of the chunk. The splits are the whole group's.
    first, last = _row_group(group_back_ptr, seq, tl.num_programs(0), SEQ_ROWS, BLOCK_R)
    own_len = tl.load(context_lens_ptr + seq)
    context_len = own_len + (last - seq)  # the group's last row's (a group's context lengths rise by one)
    window_start, first_tile, partition_size, split_end = decode_partition(context_len, window + (last - first),
                                                                           num_splits, BLOCK_N, BLOCK_SIZE, TAIL)
    part_start = first_tile + split * partition_size
    if TAIL:  # the tail's split always runs: it reads the own block's exact keys, even when no fp8 key is left
        own_split, _ = tail_split(first_tile, partition_size, split_end, num_splits)
        runs = (split == own_split) | (part_start < split_end)
    else:
        # Partitions past the context exit at once. "<=" lets an empty context (padding rows) write
        # zeros from split 0; the reduce ignores the empty partial that this also writes for split > 0.
        runs = (part_start <= context_len) & ((last - seq) % CHUNK_ROWS == 0)
    if runs:
        part_end = tl.minimum(part_start + partition_size, split_end)
        if SEQ_ROWS > 1:  # the chunk's keys end with its last row's (a later row's table columns are unspecified)
            part_end = tl.minimum(part_end, own_len)
        rows = tl.arange(0, BLOCK_G)  # query rows: row `chunk + rows // GROUP`, head `rows % GROUP` of kv_head
        dims = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + rows % GROUP
        seqs = tl.maximum(first, seq - (CHUNK_ROWS - 1)) + rows // GROUP
        row_ok = (rows < CHUNK_ROWS * GROUP) & (seqs <= seq)
        dim_ok = dims < HEAD_DIM
        q_exact = tl.load(q_ptr + seqs[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                          mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q = _product_q(q_exact, k_cache_ptr, FP8, Q_FP16)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if SEQ_ROWS == 1:  # every row shares the keys [window_start, part_end)
            first_key = tl.zeros([BLOCK_G], tl.int32) + window_start
            last_key = tl.zeros([BLOCK_G], tl.int32) + (part_end - 1)
        else:  # each row its own causal end and window
            row_len = tl.load(context_lens_ptr + seqs, mask=row_ok, other=0)
            first_key = tl.maximum(row_len - window, 0)
            last_key = tl.minimum(row_len, part_end) - 1
        for start in range(part_start, part_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, window_start,
                                         part_end, first_key, last_key, kv_head, dims, dim_ok, qk_scale, cap_scale,
                                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                         ks_ptr, vs_ptr, stride_sb, stride_st, stride_sh,
                                         BLOCK_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, SOFTCAP, FP8)
        if TAIL:  # (one row per group)
            if split == own_split:
                # The own block's keys [split_end, context_len) (those in the window), from the tail rows.
                keys = split_end + tl.arange(0, BLOCK_T)
                key_ok = (keys >= window_start) & (keys < context_len)
                at = (tail_row_tl(tl.load(slots_ptr + seq).to(tl.int64), keys, BLOCK_SIZE)[:, None] * stride_tail_row
                      + kv_head * stride_tail_h + dims[None, :])
                kv_mask = key_ok[:, None] & dim_ok[None, :]
                k = tl.load(k_tail_ptr + at, mask=kv_mask, other=0.0).to(q_exact.dtype)
                v = tl.load(v_tail_ptr + at, mask=kv_mask, other=0.0).to(q_exact.dtype)
                m_i, l_i, acc = _attend_exact(q_exact, m_i, l_i, acc, k, v, key_ok[None, :], qk_scale, cap_scale,
                                              DOT_PRECISION, DOT_UPCAST, SOFTCAP)
        out_ok = row_ok[:, None] & dim_ok[None, :]
        if not SPLIT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + seqs[:, None] * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            # Partials are [num_seqs, num_heads, num_splits, HEAD_DIM] and [..., 2], contiguous.
            part = (seqs * (tl.num_programs(1) * GROUP) + heads).to(tl.int64) * num_splits + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_ok)
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@jit
def _lanes_fold(q, m_i, l_i, acc, k, v, seen, k_scale, v_scale, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """Fold keys k / values v [1, ROWS, LANES, D] (fp32, unscaled; zero where not loaded) into the running (max, sum,
    acc) [G, 1, LANES, 1] / [G, 1, LANES, D] of the G query heads q [G, 1, 1, D]: each lane keeps a softmax of its own
    over the keys it sees (row r, lane l), so a tile needs no reduction across threads but the head_dim one of its
    scores; _lanes_merge combines the lanes once at the end. seen, k_scale / v_scale [1, ROWS, LANES, 1]: each key's.
    (Every tensor is 4-d, in the layout of the tile's load, so nothing changes layout inside the loop.)"""
    scores = _scores(tl.sum(q * k, 3, keep_dims=True) * k_scale, qk_scale, cap_scale, SOFTCAP)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1, keep_dims=True))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp2(-inf - 0) = 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1, keep_dims=True)
    acc = acc * alpha + tl.sum((p * v_scale) * v, 1, keep_dims=True)
    return m_new, l_i, acc


@jit
def _lanes_merge(m_i, l_i, acc):
    """The lanes' softmaxes ([G, 1, LANES, 1], [G, 1, LANES, D]) as one (max, sum, acc) per head ([G, 1, 1, 1],
    [G, 1, 1, D]): the split's partial."""
    m = tl.max(m_i, 2, keep_dims=True)
    weight = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m))  # a lane that saw no key weighs 0
    return m, tl.sum(l_i * weight, 2, keep_dims=True), tl.sum(acc * weight, 2, keep_dims=True)


@jit
def _lanes_raw(k_ptr, v_ptr, k_at, v_at, dims, stride_vd, ok, dim_ok):
    """The K and V rows at offsets k_at / v_at [ROWS * LANES] as stored (zero where not ok), [ROWS * LANES, D]: 2-d
    tiles, which every Triton version lays out alike (threads along head_dim, then along keys; a thread's rows LANES
    keys apart)."""
    mask = ok[:, None] & dim_ok[None, :]
    return (tl.load(k_ptr + k_at[:, None] + dims[None, :], mask=mask, other=0.0),
            tl.load(v_ptr + v_at[:, None] + dims[None, :] * stride_vd, mask=mask, other=0.0))


@jit
def _lanes_widen(k, v, ROWS: tl.constexpr, LANES: tl.constexpr):
    """_lanes_raw's tiles as fp32 [1, ROWS, LANES, D], key r * LANES + l at (r, l): the reshape moves nothing, a
    thread's rows are its registers."""
    return (tl.reshape(k.to(tl.float32), [1, ROWS, LANES, k.shape[1]]),
            tl.reshape(v.to(tl.float32), [1, ROWS, LANES, v.shape[1]]))


@jit
def _lanes_at(table, start, flat_tile, window_start, part_end, BLOCK_SIZE: tl.constexpr):
    """(block ids and in-block offsets of keys start + flat_tile, which of them to load)."""
    keys = start + flat_tile
    ok = (keys >= window_start) & (keys < part_end)
    return tl.load(table + keys // BLOCK_SIZE, mask=ok, other=0).to(tl.int64), keys % BLOCK_SIZE, ok


@jit
def _decode_lanes_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                         part_acc_ptr, part_ml_ptr, qk_scale, cap_scale, window, num_splits,
                         stride_qb, stride_qh, stride_ob, stride_oh,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_bt,
                         ks_ptr, vs_ptr, stride_sb, stride_st, stride_sh,
                         k_tail_ptr, v_tail_ptr, slots_ptr, stride_tail_row, stride_tail_h,
                         BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         ROWS: tl.constexpr, LANES: tl.constexpr, SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr,
                         TAIL: tl.constexpr = False, TAIL_ROWS: tl.constexpr = 1):
    """Decode over an fp8 cache on the CUDA cores (one query row per sequence; _decode_kernel's grid, partitions and
    partials): a tile is [ROWS, LANES] keys of head_dim codes, widened to fp32 and multiplied with each of the
    GROUP heads' q in fp32; _lanes_fold keeps a softmax per lane, so no product goes through shared memory (the
    tensor-core path's 8-bit operands do: notes/PERF.md, round 8)."""
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    window_start, first_tile, partition_size, split_end = decode_partition(context_len, window, num_splits,
                                                                           ROWS * LANES, BLOCK_SIZE, TAIL)
    part_start = first_tile + split * partition_size
    if TAIL:
        own_split, _ = tail_split(first_tile, partition_size, split_end, num_splits)
        runs = (split == own_split) | (part_start < split_end)
    else:
        runs = part_start <= context_len
    if runs:
        part_end = tl.minimum(part_start + partition_size, split_end)
        heads = kv_head * GROUP + tl.arange(0, BLOCK_G)[:, None, None, None]
        head_ok = tl.arange(0, BLOCK_G)[:, None, None, None] < GROUP
        dims = tl.arange(0, BLOCK_D)[None, None, None, :]
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qb + heads * stride_qh + dims, mask=head_ok & dim_ok, other=0.0)
        q = q.to(tl.float32)
        flat_dims = tl.arange(0, BLOCK_D)
        flat_dim_ok = flat_dims < HEAD_DIM
        tile = (tl.arange(0, ROWS)[:, None] * LANES + tl.arange(0, LANES)[None, :])[None, :, :]
        flat_tile = tl.arange(0, ROWS * LANES)  # the same keys in the loads' order
        m_i = tl.full([BLOCK_G, 1, LANES, 1], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G, 1, LANES, 1], tl.float32)
        acc = tl.zeros([BLOCK_G, 1, LANES, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kv_head * stride_kh
        v_base = v_cache_ptr + kv_head * stride_vh
        for start in range(part_start, part_end, ROWS * LANES):
            start = tl.multiple_of(start, ROWS * LANES)
            ids, offsets, ok = _lanes_at(table, start, flat_tile, window_start, part_end, BLOCK_SIZE)
            k, v = _lanes_widen(*_lanes_raw(k_base, v_base, ids * stride_kb + offsets * stride_kt,
                                            ids * stride_vb + offsets * stride_vt, flat_dims, stride_vd, ok,
                                            flat_dim_ok), ROWS, LANES)
            keys = start + tile
            key_ok = (keys >= window_start) & (keys < part_end)
            block_ids = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            offsets = keys % BLOCK_SIZE
            scale_at = block_ids * stride_sb + offsets * stride_st + kv_head * stride_sh
            k_scale = tl.load(ks_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)[:, :, :, None]
            v_scale = tl.load(vs_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)[:, :, :, None]
            m_i, l_i, acc = _lanes_fold(q, m_i, l_i, acc, k, v, key_ok[:, :, :, None], k_scale, v_scale, qk_scale,
                                        cap_scale, SOFTCAP)
        if TAIL:
            if split == own_split:  # the own block's keys [split_end, context_len) in the window, exact (tail rows)
                flat_keys = split_end + tl.arange(0, TAIL_ROWS * LANES)
                flat_ok = (flat_keys >= window_start) & (flat_keys < context_len)
                at = tail_row_tl(tl.load(slots_ptr + seq).to(tl.int64), flat_keys, BLOCK_SIZE) * stride_tail_row
                k, v = _lanes_widen(*_lanes_raw(k_tail_ptr + kv_head * stride_tail_h, v_tail_ptr + kv_head
                                                * stride_tail_h, at, at, flat_dims, 1, flat_ok, flat_dim_ok),
                                    TAIL_ROWS, LANES)
                keys = split_end + (tl.arange(0, TAIL_ROWS)[:, None] * LANES + tl.arange(0, LANES)[None, :])[None]
                key_ok = (keys >= window_start) & (keys < context_len)
                ones = tl.full([1, TAIL_ROWS, LANES, 1], 1.0, tl.float32)
                m_i, l_i, acc = _lanes_fold(q, m_i, l_i, acc, k, v, key_ok[:, :, :, None], ones, ones, qk_scale,
                                            cap_scale, SOFTCAP)
        m, l, out = _lanes_merge(m_i, l_i, acc)
        out_ok = head_ok & dim_ok
        if not SPLIT:
            out = out / tl.where(l > 0, l, 1.0)
            tl.store(out_ptr + seq * stride_ob + heads * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
                     mask=out_ok)
        else:
            part = (seq * (tl.num_programs(1) * GROUP) + heads).to(tl.int64) * num_splits + split
            tl.store(part_acc_ptr + part * HEAD_DIM + dims, out, mask=out_ok)
            tl.store(part_ml_ptr + part * 2, m, mask=head_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l, mask=head_ok)


@jit
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, context_lens_ptr, group_back_ptr, out_ptr, window, num_splits,
                          stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                          USE_PDL: tl.constexpr, BLOCK_SIZE: tl.constexpr = 1, TAIL: tl.constexpr = False,
                          SEQ_ROWS: tl.constexpr = 1, BLOCK_R: tl.constexpr = 1):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first, last = _row_group(group_back_ptr, seq, tl.num_programs(0), SEQ_ROWS, BLOCK_R)
    context_len = tl.load(context_lens_ptr + seq) + (last - seq)  # the splits are the group's (_decode_kernel)
    _window_start, first_tile, partition_size, split_end = decode_partition(context_len, window + (last - first),
                                                                            num_splits, BLOCK_N, BLOCK_SIZE, TAIL)
    if TAIL:  # those that saw fp8 keys and the tail's
        _tail, num_valid = tail_split(first_tile, partition_size, split_end, num_splits)
    else:
        num_valid = tl.cdiv(context_len - first_tile, partition_size)  # splits that saw tokens; later ones ignored
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_valid
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(split_ok, tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weight * l, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence, from static shapes only (graph-safe): enough programs to fill the GPU,
    none shorter than DECODE_MIN_PARTITION tokens."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = cdiv((DECODE_WAVES if programs >= num_sms else DECODE_WAVES_SPARSE) * num_sms, programs)
    return max(1, min(wanted, cdiv(max_context, DECODE_MIN_PARTITION), DECODE_MAX_SPLITS))


def decode_splits(num_splits: int | None, num_seqs: int, num_kv_heads: int, max_keys: int, block_n: int,
                  num_sms: int) -> int:
    """The splits a decode launches: the given count (tests, benchmarks) or decode_num_splits', at most one a key tile
    of block_n keys."""
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_keys, num_sms)
    return max(1, min(num_splits, cdiv(max_keys, block_n)))


@dataclass
class DecodePartials:
    """The split-K decode attention before its merge: per (sequence, head, split) the fp32 partial output and its
    (max, sum); merge_partials turns it into the attention output. (Merging in the o_proj GEMV's prologue instead
    was measured slower everywhere on the H200 — every program re-reads every head's partials, one split at a time —
    and removed; loading the first K/V tile before the PDL wait was slower too: notes/PERF.md, issue 34 figures,
    attention.DecodePartials.)"""

    acc: torch.Tensor  # [num_seqs * num_heads * num_splits * head_dim] fp32
    ml: torch.Tensor  # [num_seqs * num_heads * num_splits * 2] fp32
    context_lens: torch.Tensor  # [num_seqs]: with window, which splits saw tokens (decode_partition)
    window: int  # the decode kernel's window argument (NO_WINDOW: none)
    num_seqs: int
    num_heads: int
    head_dim: int
    num_splits: int
    block_n: int  # the decode kernel's key tile, which sizes the partitions
    dtype: torch.dtype  # of the attention output
    block_size: int = 1  # of the cache: with a tail, the splits cover the keys before the query's own block
    tail: bool = False  # read with a tail (one split also holds the own block's exact keys: tail_split)
    group_back: torch.Tensor | None = None  # [num_seqs] with seq_rows > 1: the rows' groups (decode_attention)
    seq_rows: int = 1


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, *, window: int | None = None,
                     softcap: float | None = None, num_splits: int | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                     slots: torch.Tensor | None = None, seq_rows: int = 1,
                     group_back: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row over its paged context → [num_seqs, num_heads, head_dim].

    q [num_seqs, num_heads, head_dim]; block_tables [num_seqs, max_blocks] int32; context_lens
    [num_seqs] int32 (0 gives a zero output row). window / softcap: paged_attention's; the splits cover only the
    window's keys. num_splits overrides the shape heuristic (tests, benchmarks). kv_tail: an fp8 cache's tail, read
    at each row's slot (slots [num_seqs]) for the keys of the query's own block (already holding the step's token);
    the splits then cover the keys before that block, and the first split without fp8 keys (else split 0) adds the
    block's.
    seq_rows > 1 (not with a tail): a sequence verifying drafts runs as consecutive rows (group_back [num_seqs]
    int32: how many of them come before each row; 0 for plain rows) whose context lengths rise by one; up to
    seq_rows such rows are one group, whose last row's programs read each key tile once for all of them (its k + 1
    queries beside its GQA heads in one tl.dot; in chunks of rows where they are more than DECODE_GROUP_TILE query
    rows), each row masked to its own context. Plain rows are groups of one. The result is the same either way.
    No host sync: safe inside CUDA-graph capture.
    """
    num_seqs, num_heads, head_dim = q.shape
    _num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads != 0 or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (head_dim must match, num_heads a multiple of num_kv_heads)")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"decode_attention: block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} must be [{num_seqs}, max_blocks] / [{num_seqs}]")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    scales, fmt = kv_quant.kernel_args(k_cache, kv_scales)
    if kv_tail is not None and (slots is None or slots.shape != (num_seqs,)):
        raise ValueError(f"decode_attention: a tail needs each row's slot (slots [{num_seqs}])")
    tail = _tail_args(kv_tail, k_cache, fmt, slots, "decode_attention")
    group = num_heads // num_kv_heads
    seq_rows = 1 if kv_tail is not None else seq_rows  # (a tail's own block is read per row)
    if seq_rows > 1 and (group_back is None or group_back.shape != (num_seqs,)):
        raise ValueError(f"decode_attention: seq_rows {seq_rows} needs group_back [{num_seqs}]")
    chunk = seq_rows if group * seq_rows <= DECODE_GROUP_TILE else max(1, DECODE_GROUP_TILE // group)
    if num_seqs == 0:
        return out
    _require_unit_last_stride(decode_attention=(q, block_tables))
    require_cache_layout("decode_attention", k_cache, v_cache)
    if SWITCHES.gluon_decode and num_seqs * num_kv_heads > DECODE_FP8_FEW_PROGRAMS and \
            attention_sm90.supports(q, k_cache, v_cache, kv_scales, window, softcap, seq_rows, kv_tail):
        return _decode_sm90(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, kv_scales, kv_tail,
                            slots, out)
    window = NO_WINDOW if window is None else window
    max_keys = min(block_tables.shape[1] * block_size, window)  # static: the window is the layer's
    block_d = max(16, next_power_of_2(head_dim))
    sms = num_sms(q.device)
    lane_rows, block_n, warps = _decode_tile(fmt["FP8"], seq_rows, group, num_seqs * num_kv_heads, sms, block_d,
                                             _compute_dtype(q, k_cache).itemsize)
    num_splits = decode_splits(num_splits, num_seqs, num_kv_heads, max_keys, block_n, sms)
    partials = decode_partials(q, context_lens, window, num_splits, block_n, block_size, kv_tail is not None,
                               group_back, seq_rows)
    part_acc, part_ml = (partials.acc, partials.ml) if partials else (out, out)  # (unused by one split)
    if lane_rows:
        _decode_lanes_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, *_score_args(scale, softcap),
            window, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *v_cache.stride(), block_tables.stride(0), *scales, *tail,
            BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, SPLIT=num_splits > 1,
            BLOCK_G=next_power_of_2(group), BLOCK_D=block_d, ROWS=lane_rows, LANES=DECODE_LANES,
            SOFTCAP=softcap is not None, TAIL=kv_tail is not None,
            TAIL_ROWS=next_power_of_2(cdiv(block_size, DECODE_LANES)),  # the own block: one tile
            num_warps=warps, num_stages=1, **pdl_args(q.device))
        return out if num_splits == 1 else merge_partials(partials, out)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, *_score_args(scale, softcap),
        window, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *v_cache.stride(), block_tables.stride(0), *scales, *tail,
        group_back if seq_rows > 1 else context_lens,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, SPLIT=num_splits > 1,
        BLOCK_G=max(16, next_power_of_2(group * chunk)), BLOCK_D=block_d, BLOCK_N=block_n,
        SOFTCAP=softcap is not None,
        FP8=fmt["FP8"], **_product_args(q, k_cache), num_warps=warps,
        num_stages=DECODE_NUM_STAGES_FP8 if fmt["FP8"] else DECODE_NUM_STAGES,
        **pdl_args(q.device), TAIL=kv_tail is not None,
        BLOCK_T=max(16, next_power_of_2(block_size)) if kv_tail is not None else 16,  # the own block: one tile
        SEQ_ROWS=seq_rows, BLOCK_R=next_power_of_2(seq_rows), CHUNK_ROWS=chunk)
    if num_splits == 1:
        return out
    return merge_partials(partials, out)


def decode_partials(q: torch.Tensor, context_lens: torch.Tensor, window: int, num_splits: int, block_n: int,
              block_size: int, tail: bool, group_back: torch.Tensor | None = None,
              seq_rows: int = 1) -> DecodePartials | None:
    """The split-K partials a decode with num_splits > 1 writes (None for one split: it writes the output)."""
    if num_splits == 1:
        return None
    num_seqs, num_heads, head_dim = q.shape
    size = num_seqs * num_heads * num_splits
    parts = torch.empty(size * (head_dim + 2), dtype=torch.float32, device=q.device)
    return DecodePartials(parts[:size * head_dim], parts[size * head_dim:], context_lens, window, num_seqs, num_heads,
                          head_dim, num_splits, block_n, q.dtype, block_size, tail, group_back, seq_rows)


def _decode_sm90(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, kv_scales, kv_tail, slots,
                 out) -> torch.Tensor:
    """decode_attention by attention_sm90's Gluon kernel (an fp8 cache on Hopper), with the same split rule,
    partials and reduce as the Triton kernels."""
    num_seqs, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_keys = block_tables.shape[1] * block_size
    num_splits = decode_splits(num_splits, num_seqs, num_kv_heads, max_keys, attention_sm90.BLOCK_N,
                               num_sms(q.device))
    partials = decode_partials(q, context_lens, NO_WINDOW, num_splits, attention_sm90.BLOCK_N, block_size,
                               kv_tail is not None)
    attention_sm90.decode(q, k_cache, v_cache, block_tables, context_lens, _score_args(scale, None)[0], kv_scales,
                          num_splits, out, *((partials.acc, partials.ml) if partials else (out, out)), kv_tail, slots)
    return out if partials is None else merge_partials(partials, out)


def _decode_tile(fp8: bool, seq_rows: int, group: int, programs: int, sms: int, block_d: int, element_size: int
                 ) -> tuple[int, int, int]:
    """(rows of the CUDA-core kernel's tile, 0: the tensor-core kernel; the key tile, which sizes the partitions; the
    tensor-core kernel's warps) of a decode over `programs` (sequence, kv head) pairs; element_size: of the
    tensor-core products' operands."""
    if fp8 and programs <= DECODE_FP8_FEW_PROGRAMS:
        return 0, DECODE_FP8_FEW_BLOCK_N, DECODE_FP8_FEW_WARPS
    if fp8 and seq_rows == 1 and group <= DECODE_LANES_MAX_GROUP and programs <= DECODE_LANES_MAX_WAVES * sms:
        rows = DECODE_LANES_ROWS if programs >= sms else DECODE_LANES_ROWS_SPARSE
        return rows, rows * DECODE_LANES, DECODE_LANES_WARPS
    if fp8:
        return 0, _kv_tile_tokens(block_d, 1, MAX_BLOCK_N_FP8), DECODE_NUM_WARPS
    return 0, _kv_tile_tokens(block_d, element_size), DECODE_NUM_WARPS


def merge_partials(p: DecodePartials, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output [num_seqs, num_heads, head_dim] from its split-K partials (one reduce launch)."""
    if out is None:
        out = torch.empty((p.num_seqs, p.num_heads, p.head_dim), dtype=p.dtype, device=p.acc.device)
    _decode_reduce_kernel[(p.num_seqs, p.num_heads)](
        p.acc, p.ml, p.context_lens, p.context_lens if p.seq_rows == 1 else p.group_back, out, p.window, p.num_splits,
        out.stride(0), out.stride(1),
        HEAD_DIM=p.head_dim, BLOCK_S=next_power_of_2(p.num_splits), BLOCK_D=next_power_of_2(p.head_dim),
        BLOCK_N=p.block_n, num_warps=4, **pdl_args(p.acc.device),
        BLOCK_SIZE=p.block_size if p.tail else 1, TAIL=p.tail,  # no tail: the one compiled reduce of every cache
        SEQ_ROWS=p.seq_rows, BLOCK_R=next_power_of_2(p.seq_rows))
    return out


# --------------------------------------------------------------------------------------------- prefill


@jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, table_rows_ptr, context_lens_ptr,
                    cu_seqlens_q_ptr, work_seq_ptr, work_start_ptr, out_ptr, qk_scale, cap_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_bt,
                    ks_ptr, vs_ptr, stride_sb, stride_st, stride_sh,
                    k_tail_ptr, v_tail_ptr, stride_tail_row, stride_tail_h,
                    k_ptr, v_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    Q_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                    SOFTCAP: tl.constexpr, FP8: tl.constexpr, Q_FP16: tl.constexpr, USE_PDL: tl.constexpr,
                    TAIL: tl.constexpr = False):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    kv_head = tl.program_id(0)  # the heads of one tile launch together, and the work list is longest first
    work = tl.program_id(1)
    seq = tl.load(work_seq_ptr + work)  # -1: an unused entry of a fixed-size (graph) work list
    if seq >= 0:
        first = tl.load(work_start_ptr + work)
        q_begin = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
        context_len = tl.load(context_lens_ptr + seq)
        # Rows are (query token, head of the group) pairs, so the group shares every K/V tile.
        rows = tl.arange(0, BLOCK_M)
        tokens = first + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        row_ok = (rows < Q_PER_TILE * GROUP) & (tokens < q_len)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_rows = (q_begin + tokens).to(tl.int64)
        q_exact = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                          mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q = _product_q(q_exact, k_cache_ptr, FP8, Q_FP16)
        # Bottom-right causal alignment: new token i sits at position context_len - q_len + i; it sees keys
        # (q_pos - window, q_pos]. Padding rows take the tile's first position, which keeps their softmax finite;
        # they are never stored.
        q_first = context_len - q_len + first
        q_pos = tl.where(row_ok, context_len - q_len + tokens, q_first)
        kv_end = tl.minimum(context_len, context_len - q_len + tl.minimum(first + Q_PER_TILE, q_len))
        # Tiles before the first row's window start are never read; keys from the last row's window start to the
        # first row's position are seen by every row: whole tiles of them go unmasked.
        kv_begin = tl.maximum(q_first - window + 1, 0)
        kv_start = kv_begin // BLOCK_N * BLOCK_N
        if TAIL:
            # Each row reads its own block exact (the pass after the fp8 ones), the cache's keys before it: the fp8
            # keys end at the last row's own block, and the unmasked tiles before the first row's.
            own_first = q_first // BLOCK_SIZE * BLOCK_SIZE
            far_end = (kv_end - 1) // BLOCK_SIZE * BLOCK_SIZE
            full_end = tl.maximum(own_first // BLOCK_N * BLOCK_N, kv_start)
            last_far = tl.minimum(q_pos, q_pos // BLOCK_SIZE * BLOCK_SIZE - 1)
        else:
            far_end = kv_end
            full_end = (q_first + 1) // BLOCK_N * BLOCK_N
            last_far = q_pos
        full_start = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
        first_key = q_pos - window + 1
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + tl.load(table_rows_ptr + seq).to(tl.int64) * stride_bt
        for start in range(kv_start, full_start, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, kv_begin, far_end,
                                         first_key, last_far, kv_head, dims, dim_ok, qk_scale, cap_scale, stride_kb,
                                         stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, ks_ptr,
                                         vs_ptr, stride_sb, stride_st, stride_sh, BLOCK_SIZE, BLOCK_N,
                                         DOT_PRECISION, DOT_UPCAST, SOFTCAP, FP8)
        for start in range(full_start, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, kv_begin, far_end,
                                         first_key, last_far, kv_head, dims, dim_ok, qk_scale, cap_scale, stride_kb,
                                         stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, ks_ptr,
                                         vs_ptr, stride_sb, stride_st, stride_sh, BLOCK_SIZE, BLOCK_N,
                                         DOT_PRECISION, DOT_UPCAST, SOFTCAP, FP8, MASKED=False)
        for start in range(full_end, far_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, start, kv_begin, far_end,
                                         first_key, last_far, kv_head, dims, dim_ok, qk_scale, cap_scale, stride_kb,
                                         stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, ks_ptr,
                                         vs_ptr, stride_sb, stride_st, stride_sh, BLOCK_SIZE, BLOCK_N,
                                         DOT_PRECISION, DOT_UPCAST, SOFTCAP, FP8)
        if TAIL:
            # Keys [own_first, kv_end), exact: the step's own k/v from its first position (context_len - q_len) on,
            # the tail rows before it; row r sees those of its own block up to itself (and in its window).
            slot = tl.load(table_rows_ptr + seq).to(tl.int64)
            q_block = q_pos // BLOCK_SIZE
            for start in range(tl.maximum(own_first, kv_begin), kv_end, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                key_ok = keys < kv_end
                fresh = keys >= context_len - q_len
                new_rows = (q_begin + keys - (context_len - q_len)).to(tl.int64)
                tail_at = tail_row_tl(slot, keys, BLOCK_SIZE)[:, None] * stride_tail_row + kv_head * stride_tail_h
                fresh_mask = (key_ok & fresh)[:, None] & dim_ok[None, :]
                tail_mask = (key_ok & ~fresh)[:, None] & dim_ok[None, :]
                k = tl.where(fresh[:, None],
                             tl.load(k_ptr + new_rows[:, None] * stride_knt + kv_head * stride_knh + dims[None, :],
                                     mask=fresh_mask, other=0.0).to(q_exact.dtype),
                             tl.load(k_tail_ptr + tail_at + dims[None, :], mask=tail_mask, other=0.0).to(q_exact.dtype))
                v = tl.where(fresh[:, None],
                             tl.load(v_ptr + new_rows[:, None] * stride_vnt + kv_head * stride_vnh + dims[None, :],
                                     mask=fresh_mask, other=0.0).to(q_exact.dtype),
                             tl.load(v_tail_ptr + tail_at + dims[None, :], mask=tail_mask, other=0.0).to(q_exact.dtype))
                seen = (key_ok[None, :] & (keys[None, :] // BLOCK_SIZE == q_block[:, None])
                        & (keys[None, :] <= q_pos[:, None]) & (keys[None, :] >= first_key[:, None]))
                m_i, l_i, acc = _attend_exact(q_exact, m_i, l_i, acc, k, v, seen, qk_scale, cap_scale,
                                              DOT_PRECISION, DOT_UPCAST, SOFTCAP)
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_q_per_tile(num_heads: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Query tokens per program of the paged prefill kernel: the unit of its work list (prefill_work)."""
    return prefill_tiles(num_heads // num_kv_heads, head_dim, element_size).q_per_tile


def prefill_work(query_lens, q_per_tile: int, context_lens=None) -> tuple[np.ndarray, np.ndarray]:
    """The paged prefill kernel's work list (host, vectorised): one (sequence, first query token) per tile of
    q_per_tile tokens. Its length is at most prefill_work_capacity(sum(query_lens), len(query_lens), q_per_tile).
    With context_lens the list is ordered by the keys each tile reads, most first: the GPU starts the longest
    programs first, so a long prompt's last tiles do not start after the short ones and finish alone."""
    q = np.asarray(query_lens, dtype=np.int64)
    tiles = -(-q // q_per_tile)
    seq = np.repeat(np.arange(len(q), dtype=np.int32), tiles)
    start = (np.arange(len(seq), dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * q_per_tile
    if context_lens is not None and len(seq) > 1:
        ctx = np.asarray(context_lens, dtype=np.int64)[seq]
        keys = ctx - q[seq] + np.minimum(start + q_per_tile, q[seq])
        order = np.argsort(-keys, kind="stable")
        seq, start = seq[order], start[order]
    return seq, start.astype(np.int32)


def prefill_work_capacity(num_tokens: int, max_seqs: int, q_per_tile: int) -> int:
    """Most tiles num_tokens query tokens over at most max_seqs sequences can need (each adds one partial tile)."""
    return cdiv(num_tokens, q_per_tile) + min(num_tokens, max_seqs)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionInputs, scale: float, tiles: PrefillTiles | None = None, *,
                            window: int | None = None, softcap: float | None = None,
                            kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                            kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None, k: torch.Tensor | None = None,
                            v: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (cached prefix included), each token
    over the last `window` keys (paged_attention's window / softcap; a tile reads no key tile that lies wholly
    before its first token's window).

    q [num_new_tokens, num_heads, head_dim]; the new tokens' k/v must already be in the cache.
    One launch over (work tile, kv head): meta.work_seq / work_start list the tiles (a fixed-size list whose
    unused entries are -1 under CUDA graphs; built here from the host lengths when absent), so the grid depends
    on no sequence length and the launch can be captured; meta.table_rows maps sequences to block-table rows.
    tiles: another tiling than prefill_tiles' (benchmarks/prefill_attention_tiles.py; a given work list must have
    been built with its q_per_tile).
    kv_tail: an fp8 cache's tail, read at each sequence's slot (meta.table_rows); each token then reads its own
    block's keys exact, the step's own from k / v [num_new_tokens, num_kv_heads, head_dim] (views allowed), the
    earlier ones from the tail.
    """
    num_tokens, num_heads, head_dim = q.shape
    _num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads != 0 or v_cache.shape != k_cache.shape:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}")
    if meta.cu_seqlens_q is None:
        raise ValueError("prefill_attention needs meta.cu_seqlens_q")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    scales, fmt = kv_quant.kernel_args(k_cache, kv_scales)
    rows = meta.table_rows
    if rows is None:
        rows = torch.arange(meta.num_seqs, dtype=torch.int32, device=q.device)
    k_tail, v_tail, _rows, *tail_strides = _tail_args(kv_tail, k_cache, fmt, rows, "prefill_attention")
    fresh = (q, q, 0, 0, 0, 0)  # unused without a tail
    if kv_tail is not None:
        if k is None or v is None or k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
            raise ValueError(f"prefill_attention: a tail needs the step's k and v [{num_tokens}, {num_kv_heads}, "
                             f"{head_dim}]")
        _require_unit_last_stride(prefill_attention=(k, v))
        fresh = (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    if num_tokens == 0:
        return out
    _require_unit_last_stride(prefill_attention=(q, meta.block_tables))
    require_cache_layout("prefill_attention", k_cache, v_cache)
    tiles = tiles or prefill_tiles(num_heads // num_kv_heads, head_dim, _compute_dtype(q, k_cache).itemsize,
                                   fmt["FP8"])
    work_seq, work_start = meta.work_seq, meta.work_start
    if work_seq is None:
        lens = meta.query_lens_host or torch.diff(meta.cu_seqlens_q).tolist()
        ctx = meta.context_lens_host or meta.context_lens.tolist()
        work_seq, work_start = (torch.from_numpy(a).to(q.device) for a in prefill_work(lens, tiles.q_per_tile, ctx))
    _prefill_kernel[(num_kv_heads, work_seq.shape[0])](
        q, k_cache, v_cache, meta.block_tables, rows, meta.context_lens, meta.cu_seqlens_q, work_seq, work_start,
        out, *_score_args(scale, softcap), NO_WINDOW if window is None else window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *v_cache.stride(), meta.block_tables.stride(0), *scales, k_tail, v_tail,
        *tail_strides, *fresh,
        BLOCK_SIZE=block_size, GROUP=tiles.group, HEAD_DIM=head_dim, Q_PER_TILE=tiles.q_per_tile,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, SOFTCAP=softcap is not None,
        FP8=fmt["FP8"], **_product_args(q, k_cache),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(q.device), TAIL=kv_tail is not None)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionInputs, scale: float, *, window: int | None = None,
                      softcap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal varlen prefill → [num_new_tokens, num_heads, head_dim].

    Without a cached prefix every sequence's keys are exactly its new k/v (q_len == k_len), which is
    what torch's flash varlen forward computes (CUDA, fp16/bf16; a sliding window W is its window_size_left W - 1,
    as transformers passes it to flash-attn). Everything else (prefix-cache hits, a softcap, which it lacks, fp32,
    older torch, k/v only in the cache, an fp8 cache: the fresh tokens then see their keys as later steps will, in
    fp8, except those of their own block with its tail, kv_tail) takes the paged Triton kernel over the cache.
    """
    if kv_scales is None and kv_tail is None and _can_use_varlen(q, k, v, meta, window, softcap):
        cu, longest = meta.cu_seqlens_q, meta.max_seqlen_q
        sliding = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        return _FLASH_VARLEN(q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale, **sliding)[0]
    tail = {} if kv_tail is None else {"kv_tail": kv_tail, "k": k, "v": v}
    return paged_prefill_attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap,
                                   kv_scales=kv_scales, **tail)


# --------------------------------------------------------------------------------------------- helpers


def _flash_varlen():
    """torch's flash varlen forward, called as the aten op that torch.nn.attention.varlen.varlen_attn wraps (causal;
    flash takes GQA's fewer k/v heads as they are): the wrapper's custom-op and dynamo layers cost more host time than
    the launch (eager prompt steps over the largest token-count graph are host-bound). None when this torch lacks
    it; and whether it takes a sliding window (window_size_left)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    try:
        names = {a.name for a in op.default._schema.arguments} if op is not None else set()
    except RuntimeError:
        return None, False
    if not {"cum_seq_q", "max_q", "is_causal", "scale"} <= names:
        return None, False
    return op.default, {"window_size_left", "window_size_right"} <= names


_FLASH_VARLEN, _FLASH_WINDOWS = _flash_varlen()


def _can_use_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionInputs, window: int | None,
                    softcap: float | None) -> bool:
    head_dim = q.shape[-1]
    return (_FLASH_VARLEN is not None and softcap is None and (window is None or _FLASH_WINDOWS)
            and not meta.has_cached_prefix and q.is_cuda and k is not None and v is not None
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and head_dim % 8 == 0 and head_dim <= 256
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def _score_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """The kernels' (qk_scale, cap_scale) arguments: see _scores."""
    if softcap is None:
        return scale * _LOG2E, 0.0
    return 2.0 * scale * _LOG2E / softcap, softcap * _LOG2E


def _kv_tile_tokens(block_d: int, element_size: int, max_tokens: int = MAX_BLOCK_N) -> int:
    return max(16, min(max_tokens, KV_TILE_BYTES // (block_d * element_size)))


@dataclass(frozen=True)
class PrefillTiles:
    """One tiling of the paged prefill kernel. Rows are (query token, head of the group) pairs: a tile of block_m
    rows holds q_per_tile tokens of all `group` heads that share a kv head, and reads block_n keys at a time."""

    group: int
    block_d: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def q_per_tile(self) -> int:
        return self.block_m // self.group  # a non-power-of-two group leaves a few rows idle


def prefill_tiles(group: int, head_dim: int, element_size: int, fp8: bool = False) -> PrefillTiles:
    """The tiling that compiles without register spills on sm_90 (checked with ptxas) for this head shape (element_size:
    of the products' operands; fp8: over an fp8 cache)."""
    block_d = max(16, next_power_of_2(head_dim))
    block_m = 32 if element_size >= 4 and block_d >= 256 else 64
    num_warps = 4 if element_size <= 2 and block_d <= 128 else 8
    return PrefillTiles(group, block_d, max(block_m, next_power_of_2(group)), _kv_tile_tokens(block_d, element_size),
                        num_warps, PREFILL_NUM_STAGES_FP8 if fp8 else PREFILL_NUM_STAGES)


def _compute_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """The dtype K/V tiles are multiplied in: the cache's; for an fp8 cache (widened in registers) fp16 when q is
    16-bit (_product_q), else q's."""
    if not kv_quant.is_fp8(cache.dtype):
        return cache.dtype
    return torch.float16 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype


def _product_args(q: torch.Tensor, cache: torch.Tensor) -> dict:
    """The read kernels' product constexprs: Q_FP16 (_product_q) and _dot_args for the products' dtype."""
    compute = _compute_dtype(q, cache)
    return {"Q_FP16": compute != q.dtype, **_dot_args(q.device, compute)}


def _dot_args(device: torch.device, dtype: torch.dtype) -> dict:
    """fp32 caches get exact fp32 dots (tf32 would cost ~1e-3 relative error for no benefit here);
    off CUDA the kernels run in the Triton interpreter, which needs the fp32 upcast of _dot."""
    upcast = device.type != "cuda"
    return {"DOT_PRECISION": "ieee" if upcast or dtype == torch.float32 else "tf32", "DOT_UPCAST": upcast}


def _require_unit_last_stride(**groups: tuple[torch.Tensor, ...]) -> None:
    for name, tensors in groups.items():
        for t in tensors:
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: tensors need a contiguous last dimension, got shape {tuple(t.shape)} "
                                 f"strides {t.stride()}")


def _tail_args(kv_tail: tuple[torch.Tensor, torch.Tensor] | None, cache: torch.Tensor, fmt: dict,
               index: torch.Tensor | None, name: str) -> tuple:
    """The kernels' tail arguments (k_tail, v_tail, index, row stride, head stride): an fp8 cache's tail
    ([rows, num_kv_heads, head_dim], K and V alike) and its per-token rows or per-sequence slots (index). Without a
    tail, unused pointers (the cache) and zero strides."""
    if kv_tail is None:
        return cache, cache, cache, 0, 0
    k_tail, v_tail = kv_tail
    if not fmt["FP8"]:
        raise ValueError(f"{name}: a KV tail belongs to an fp8 cache (kv_scales)")
    if index is None:
        raise ValueError(f"{name}: a KV tail needs each token's tail row / each sequence's slot")
    if (k_tail.dim() != 3 or tuple(k_tail.shape[1:]) != tuple(cache.shape[2:]) or v_tail.shape != k_tail.shape
            or v_tail.stride() != k_tail.stride() or v_tail.dtype != k_tail.dtype):
        raise ValueError(f"{name}: tails {tuple(k_tail.shape)} / {tuple(v_tail.shape)} must both be [rows, "
                         f"{cache.shape[2]}, {cache.shape[3]}], with the same strides and dtype")
    _require_unit_last_stride(**{name: (k_tail, v_tail)})
    return k_tail, v_tail, index, k_tail.stride(0), k_tail.stride(1)
