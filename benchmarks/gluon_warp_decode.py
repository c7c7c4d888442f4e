"""Experiment (issue 37): an fp8 decode attention in Gluon whose warps are independent, FlashDecoding-style: each warp
multiplies its own 32 keys of every tile with Ampere-style fp8 `mma.sync m16n8k32` (the GQA group's heads as M = 16
rows: hi parts in rows 0-7, lo parts in rows 8-15), keeps its own running max, sum and output, and the warps meet
once, at the end of the partition. (gluon_fp8_decode.py's keys-as-M wgmma makes every tile's reductions cross warps:
482 instructions and 10 CTA barriers a warp per 64 keys.) Here a tile costs two barriers (the ring's, and one Triton
places before the copies into the next stage), the probabilities reach the second product by in-warp shuffles; K and
V^T (token-major within each block) go through ldmatrix (8-bit operands must be K-major), by cp.async or, over
32-token blocks stored head-major ([blocks, kv_heads, block, d]), by TMA; the (K, V) scale pairs through the ring.
Measured on an H100 (notes/PERF.md round 8, ninth session): over 32-token blocks 0.85-0.91 of the copy bandwidth at
Qwen3-0.6B b = 256 and 0.92-0.97 at Llama-3.1-8B b = 16 over 32k tokens; over 16-token blocks 0.74 / 0.80.

    python benchmarks/gluon_warp_decode.py --bf16 --head-major --json out.json   # GPU (Hopper, Gluon): µs a layer
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_dot_decode import bf16_run, measure_points, split_partials  # noqa: E402
from gluon_fp8_decode import _program_keys, _split8  # noqa: E402
from nanoserve.kernels import attention as A  # noqa: E402

WARP_KEYS = 32  # keys a warp multiplies per tile: mma.sync m16n8k32's K for the second product


@gluon.jit
def _warp_keys(start, W: gl.constexpr, LAYOUT: gl.constexpr):
    """[W, 32]: warp w's keys of the tile at `start` (start + 32 w + j) in LAYOUT."""
    return start + gl.arange(0, W, gl.SliceLayout(1, LAYOUT))[:, None] * 32 + \
        gl.arange(0, 32, gl.SliceLayout(0, LAYOUT))[None, :]


@gluon.jit
def _warp_blocks(table, start, end, BLOCK_SIZE: gl.constexpr, W: gl.constexpr, KC: gl.constexpr, VC: gl.constexpr,
                 SC: gl.constexpr):
    """The block ids of the tile at `start` ([W, 32], 0 past `end`) as the K, V and scale copies each hold them: three
    loads (L1 hits) a tile ahead instead of two layout conversions through shared memory on the way."""
    k_keys = _warp_keys(start, W, gl.SliceLayout(2, KC))
    v_keys = _warp_keys(start, W, gl.SliceLayout(1, VC))
    s_keys = _warp_keys(start, W, gl.SliceLayout(2, SC))
    return (gl.load(table + k_keys // BLOCK_SIZE, mask=k_keys < end, other=0),
            gl.load(table + v_keys // BLOCK_SIZE, mask=v_keys < end, other=0),
            gl.load(table + s_keys // BLOCK_SIZE, mask=s_keys < end, other=0))


@gluon.jit
def _issue_tma(k_desc, v_desc, k_tile, v_tile, bar, table, start, end, kv_head, BLOCK_SIZE: gl.constexpr,
               HEAD_DIM: gl.constexpr, W: gl.constexpr, IDS: gl.constexpr):
    """K and V^T of keys [start, start + W · 32) by TMA, one [32, head_dim] and one [head_dim, 32] box a warp (32-token
    blocks, each kv head's K rows and V^T rows of a block contiguous), completing `bar`; a warp's keys past `end` copy
    block 0 (masked; a constant byte count), a tile past `end` nothing (never waited on)."""
    if start < end:
        j = gl.arange(0, W, IDS)
        keys = start + j * 32
        ids = gl.load(table + keys // BLOCK_SIZE, mask=keys < end, other=0)
        mbarrier.expect(bar, 2 * W * 32 * HEAD_DIM)
        for w in gl.static_range(W):
            row = gl.sum(gl.where(j == w, ids, 0), 0) * gl.num_programs(0) + kv_head
            tma.async_copy_global_to_shared(k_desc, [row * 32, 0], bar, k_tile.slice(w * 32, 32, 0))
            tma.async_copy_global_to_shared(v_desc, [row * HEAD_DIM, 0], bar, v_tile.slice(w * HEAD_DIM, HEAD_DIM, 0))


@gluon.jit
def _issue(k_tile, v_tile, s_tile, k_ptr, v_ptr, s_ptr, k_blocks, v_blocks, s_blocks, start, end, kv_head,
           stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, stride_sb, stride_st, stride_sh,
           BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, W: gl.constexpr, KC: gl.constexpr, VC: gl.constexpr,
           SC: gl.constexpr, KV_CP: gl.constexpr):
    """cp.async of keys [start, start + W · 32) into one stage, each warp its own 32 keys: K [W, 32, head_dim] (16
    bytes along head_dim) and V^T [W, head_dim, 32] (a block's 16 keys of one dim, token-major V) unless they come
    by TMA, and the (K, V) scale pairs [W, 32, 2] (4 bytes a key); keys at or past `end` zero-filled."""
    if KV_CP:
        _issue_kv(k_tile, v_tile, k_ptr, v_ptr, k_blocks, v_blocks, start, end, kv_head, stride_kb, stride_kt,
                  stride_kh, stride_vb, stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, W, KC, VC)
    SK: gl.constexpr = gl.SliceLayout(2, SC)
    skeys = _warp_keys(start, W, SK)
    s_at = (s_blocks.to(gl.int64) * stride_sb + (skeys % BLOCK_SIZE) * stride_st + kv_head * stride_sh)
    s_at = s_at[:, :, None] + gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, SC)))[None, None, :]
    s_at = gl.max_contiguous(gl.multiple_of(s_at, [1, 1, 2]), [1, 1, 2])
    cp.async_copy_global_to_shared(s_tile, s_ptr + s_at, mask=(skeys < end)[:, :, None])


@gluon.jit
def _issue_kv(k_tile, v_tile, k_ptr, v_ptr, k_blocks, v_blocks, start, end, kv_head, stride_kb, stride_kt, stride_kh,
              stride_vb, stride_vh, stride_vd, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, W: gl.constexpr,
              KC: gl.constexpr, VC: gl.constexpr):
    """_issue's K and V^T copies by cp.async."""
    keys = _warp_keys(start, W, gl.SliceLayout(2, KC))
    blocks = k_blocks.to(gl.int64)
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(1, KC)))
    k_at = (blocks * stride_kb + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh)[:, :, None]
    cp.async_copy_global_to_shared(k_tile, k_ptr + k_at + dims[None, None, :], mask=(keys < end)[:, :, None])
    VK: gl.constexpr = gl.SliceLayout(1, VC)
    vkeys = _warp_keys(start, W, VK)
    vblocks = v_blocks.to(gl.int64)
    v_dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(2, VC)))
    v_at = (vblocks * stride_vb + kv_head * stride_vh + vkeys % BLOCK_SIZE)[:, None, :] + \
        (v_dims * stride_vd)[None, :, None]
    v_at = gl.max_contiguous(gl.multiple_of(v_at, [1, 1, 16]), [1, 1, 16])
    v_ok = gl.max_constancy((vkeys // BLOCK_SIZE * BLOCK_SIZE < end)[:, None, :], [1, 1, 16])
    cp.async_copy_global_to_shared(v_tile, v_ptr + v_at, mask=v_ok)


@gluon.jit
def _row_halves(x):
    """[W, 16, C] → rows 0-7 and rows 8-15, each [W, 8, C] (a thread holds row r and r + 8 of an m16n8 tile)."""
    W: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[2]
    return gl.split(gl.permute(gl.reshape(x, [W, 2, 8, C]), (0, 2, 3, 1)))


@gluon.jit
def _stack_rows(a, b):
    """[W, 8, C] twice → [W, 16, C]: a in rows 0-7, b in rows 8-15 (_row_halves' inverse)."""
    W: gl.constexpr = a.shape[0]
    C: gl.constexpr = a.shape[2]
    return gl.reshape(gl.permute(gl.join(a, b), (0, 3, 1, 2)), [W, 16, C])


@gluon.jit
def _load_q(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, W: gl.constexpr,
            QL: gl.constexpr, QA: gl.constexpr):
    """The group's query rows as mma.sync's A operand [W, 16, head_dim] (every warp the same: hi parts in rows 0-7, lo
    parts in rows 8-15, rows past the group zero), and each row's scale [W, 8]."""
    rows = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(1, QL)))
    warps = gl.arange(0, W, gl.SliceLayout(1, gl.SliceLayout(2, QL)))
    at = seq * stride_qb + (kv_head * GROUP + rows)[None, :, None] * stride_qh + dims[None, None, :] + \
        warps[:, None, None] * 0
    q = gl.load(q_ptr + at, mask=(rows < GROUP)[None, :, None] & (warps >= 0)[:, None, None], other=0.0)
    q = q.to(gl.float32)
    amax = gl.max(gl.abs(q), 2)
    scale = gl.where(amax > 0, amax / 448.0, 1.0)
    hi, lo = _split8(q / scale[:, :, None])
    return gl.convert_layout(_stack_rows(hi, lo), QA), scale


@gluon.jit
def _warp_fp8_decode_kernel(q_ptr, k_ptr, k_desc, v_ptr, v_desc, s_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr,
                            part_ml_ptr, qk_scale, window, num_splits, stride_qb, stride_qh, stride_ob, stride_oh,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, stride_bt, stride_sb,
                            stride_st, stride_sh, BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                            SPLIT: gl.constexpr, STAGES: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr,
                            S_SMEM: gl.constexpr, S_READ: gl.constexpr, TMA: gl.constexpr,
                            num_warps: gl.constexpr):
    """Split-K decode over an fp8 cache with per-token scales (_decode_kernel's grid order (kv heads, sequences,
    splits) and partials): a tile is num_warps × 32 keys, warp w's 32 its own; per warp scores [16, 32] = q · K^T and
    output [16, head_dim] += p · V as mma.sync e4m3 × e4m3 → fp32 (rows 0-7 the hi parts, 8-15 the lo parts)."""
    W: gl.constexpr = num_warps
    BLOCK_N: gl.constexpr = W * 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(0, MMA, 4)
    OPB: gl.constexpr = gl.DotOperandLayout(1, MMA, 4)
    KC: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32 // (HEAD_DIM // 16), HEAD_DIM // 16], [W, 1, 1], [2, 1, 0])
    VC: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 16, 2], [W, 1, 1], [2, 1, 0])
    SC: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [W, 1, 1], [2, 1, 0])
    IDS: gl.constexpr = gl.BlockedLayout([W], [32], [W], [0])  # every thread all the warps' block ids
    kv_head, seq, split, part_start, part_end = _program_keys(lens_ptr, window, num_splits, BLOCK_N)
    if part_start <= part_end:  # an empty partition writes an empty partial (the reduce ignores it)
        table = tables_ptr + seq.to(gl.int64) * stride_bt
        if TMA:  # (rank-2 NVMMA layouts: a warp's TMA boxes are row slices)
            k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W * 32, HEAD_DIM], K_SMEM)
            v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W * HEAD_DIM, 32], V_SMEM)
        else:
            k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W, 32, HEAD_DIM], K_SMEM)
            v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W, HEAD_DIM, 32], V_SMEM)
        s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, W, 32, 2], S_SMEM)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if TMA:
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            first = part_start + s * BLOCK_N
            if TMA:
                _issue_tma(k_desc, v_desc, k_smem.index(s), v_smem.index(s), bars.index(s), table, first, part_end,
                           kv_head, BLOCK_SIZE, HEAD_DIM, W, IDS)
            k_ids, v_ids, s_ids = _warp_blocks(table, first, part_end, BLOCK_SIZE, W, KC, VC, SC)
            _issue(k_smem.index(s), v_smem.index(s), s_smem.index(s), k_ptr, v_ptr, s_ptr, k_ids, v_ids, s_ids, first,
                   part_end, kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, stride_sb,
                   stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, W, KC, VC, SC, not TMA)
            cp.commit_group()
        k_blocks, v_blocks, s_blocks = _warp_blocks(table, part_start + (STAGES - 1) * BLOCK_N, part_end, BLOCK_SIZE,
                                                    W, KC, VC, SC)
        q_a, q_scale = _load_q(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, HEAD_DIM, W, QL, OPA)
        s_zero = gl.zeros([W, 16, 32], gl.float32, MMA)
        halves = _row_halves(s_zero)[0]  # [W, 8, 32] zeros in the layout of the scores' halves
        rows8 = gl.max(halves, 2)  # [W, 8] zeros in their per-row layout
        KEYS: gl.constexpr = gl.SliceLayout(1, halves.type.layout)  # [W, 32]: a per-key value, as a score's column
        col_scale = gl.convert_layout(q_scale, rows8.type.layout) * qk_scale
        m_i = rows8 + float("-inf")
        l_i = rows8
        unit = rows8 + 1.0  # acc holds the output times `unit` (the warp's last w_mul)
        acc = gl.zeros([W, 16, HEAD_DIM], gl.float32, MMA)
        key_ids = (gl.arange(0, W, gl.SliceLayout(1, KEYS))[:, None] * 32
                   + gl.arange(0, 32, gl.SliceLayout(0, KEYS))[None, :])
        for t in range(gl.cdiv(part_end - part_start, BLOCK_N)):
            start = part_start + t * BLOCK_N
            stage = t % STAGES
            cp.wait_group(STAGES - 2)  # tile t's copies (this thread's), then everyone's: the barrier also ends every
            if TMA:
                mbarrier.wait(bars.index(stage), (t // STAGES) & 1)
            gl.thread_barrier()  # warp's reads of the stage refilled next, tile t - 1's (so no second barrier)
            ahead = (t + STAGES - 1) % STAGES
            issue = start + (STAGES - 1) * BLOCK_N
            if TMA:
                fence_async_shared()
                _issue_tma(k_desc, v_desc, k_smem.index(ahead), v_smem.index(ahead), bars.index(ahead), table, issue,
                           part_end, kv_head, BLOCK_SIZE, HEAD_DIM, W, IDS)
            _issue(k_smem.index(ahead), v_smem.index(ahead), s_smem.index(ahead), k_ptr, v_ptr, s_ptr, k_blocks,
                   v_blocks, s_blocks, issue, part_end, kv_head, stride_kb, stride_kt, stride_kh, stride_vb,
                   stride_vh, stride_vd, stride_sb, stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, W, KC, VC, SC, not TMA)
            cp.commit_group()
            k_blocks, v_blocks, s_blocks = _warp_blocks(table, issue + BLOCK_N, part_end, BLOCK_SIZE, W, KC, VC, SC)
            k_tile = k_smem.index(stage).reshape([W, 32, HEAD_DIM]) if TMA else k_smem.index(stage)
            s16 = mma_v2(q_a, k_tile.permute((0, 2, 1)).load(OPB), s_zero)
            k_scale, v_scale = gl.split(s_smem.index(stage).load(S_READ))
            k_scale = gl.convert_layout(k_scale, KEYS, assert_trivial=True).to(gl.float32)
            v_scale = gl.convert_layout(v_scale, KEYS, assert_trivial=True).to(gl.float32)
            s_hi, s_lo = _row_halves(s16)
            scores = (s_hi + s_lo * 0.0625) * col_scale[:, :, None] * k_scale[:, None, :]
            scores = gl.where(((start + key_ids) < part_end)[:, None, :], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, 2))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp with no key yet: p = 0, alpha = 0
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(scores - m_use[:, :, None])
            l_i = l_i * alpha + gl.sum(p, 2)
            v_wide = halves + v_scale[:, None, :]
            v_max = gl.max(v_wide, 2)  # [W, 8]: the warp's, on every row (no layout conversion)
            w_mul = gl.where(v_max > 0, 448.0 / v_max, 1.0)  # p ≤ 1: p · v_scale · w_mul within e4m3's range
            w_hi, w_lo = _split8(p * v_wide * w_mul[:, :, None])
            factor = alpha * (w_mul / unit)
            unit = w_mul
            acc_hi, acc_lo = _row_halves(acc)
            factor = gl.convert_layout(factor, gl.SliceLayout(2, acc_hi.type.layout), assert_trivial=True)
            acc = gl.convert_layout(_stack_rows(acc_hi * factor[:, :, None], acc_lo * factor[:, :, None]), MMA,
                                    assert_trivial=True)
            v_tile = v_smem.index(stage).reshape([W, HEAD_DIM, 32]) if TMA else v_smem.index(stage)
            acc = mma_v2(gl.convert_layout(_stack_rows(w_hi, w_lo), OPA), v_tile.permute((0, 2, 1)).load(OPB), acc)
            m_i = m_new
        cp.wait_group(0)
        _finish(acc, m_i, l_i, unit, seq, kv_head, split, num_splits, out_ptr, part_acc_ptr, part_ml_ptr, stride_ob,
                stride_oh, GROUP, HEAD_DIM, SPLIT)


@gluon.jit
def _finish(acc, m_i, l_i, unit, seq, kv_head, split, num_splits, out_ptr, part_acc_ptr, part_ml_ptr, stride_ob,
            stride_oh, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    """The warps' (max, sum, output) merged into the partition's, then stored: the partial, or the output."""
    acc_hi, acc_lo = _row_halves(acc)
    m = gl.max(m_i, 0)  # [8]
    f = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - gl.where(m == float("-inf"), 0.0, m)[None, :]))
    f_out = gl.convert_layout(f / unit, gl.SliceLayout(2, acc_hi.type.layout))
    out = gl.sum((acc_hi + acc_lo * 0.0625) * f_out[:, :, None], 0)
    l_sum = gl.sum(l_i * f, 0)
    OUT: gl.constexpr = out.type.layout
    rows = gl.arange(0, 8, gl.SliceLayout(1, OUT))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, OUT))
    heads = kv_head * GROUP + rows
    ok = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    if SPLIT:
        part = (seq * (gl.num_programs(0) * GROUP) + heads).to(gl.int64) * num_splits + split
        gl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=ok)
        ml_rows = gl.arange(0, 8, m.type.layout)
        ml_part = (seq * (gl.num_programs(0) * GROUP) + kv_head * GROUP + ml_rows).to(gl.int64) * num_splits + split
        gl.store(part_ml_ptr + ml_part * 2, m, mask=ml_rows < GROUP)
        gl.store(part_ml_ptr + ml_part * 2 + 1, gl.convert_layout(l_sum, m.type.layout), mask=ml_rows < GROUP)
    else:
        l_out = gl.convert_layout(l_sum, gl.SliceLayout(1, OUT))
        out = out / gl.where(l_out > 0, l_out, 1.0)[:, None]
        gl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok)


def interleaved_scales(kv_scales):
    """(K scales, V scales) [blocks, block_size, kv_heads] → [blocks, block_size, kv_heads, 2]: a key's two scales in
    one 4-byte copy (the layout the kernel's ring copies)."""
    return torch.stack(kv_scales, dim=-1).contiguous()


def smem_layouts(head_dim: int, tma: bool) -> dict:
    """K stages [W, 32, head_dim] and V^T stages [W, head_dim, 32], read by ldmatrix (each 16-byte row chunk of a
    thread's 8 × 8 b16 matrices swizzled across the banks; by TMA, its swizzles by row bytes), and the scale pairs
    [W, 32, 2]."""
    if tma:
        nvmma = gl.NVMMASharedLayout
        kv = {"K_SMEM": nvmma(swizzle_byte_width=min(128, head_dim), element_bitwidth=8, rank=2),
              "V_SMEM": nvmma(swizzle_byte_width=32, element_bitwidth=8, rank=2)}
    else:
        kv = {"K_SMEM": gl.SwizzledSharedLayout(16, 1, min(8, head_dim // 16), [2, 1, 0]),
              "V_SMEM": gl.SwizzledSharedLayout(16, 4, 2, [2, 1, 0])}
    return {**kv, "S_SMEM": gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])}


def scale_read_layout(num_warps: int):
    """[W, 32, 2] (each key's K and V scale) in registers as the scores' halves hold a key's column (a thread: keys
    2 (l % 4) + {0, 1} + 8 i of its warp's 32, the pair innermost): split, the scores' per-key layout with no data
    movement (the kernel asserts the conversion trivial)."""
    warps = [[1 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout([[0, 0, 1], [0, 1, 0], [0, 8, 0], [0, 16, 0]],
                                      [[0, 2, 0], [0, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], warps, [],
                                      [num_warps, 32, 2])


def warp_decode(q, k_cache, v_cache_t, tables, lens, scale, paired_scales, *, num_warps=2, stages=2, num_splits=None,
                tma=False, maxnreg=None):
    """q [b, heads, d] bf16 over an fp8 cache (k_cache [blocks, block, kv_heads, d], v_cache_t [blocks, kv_heads, d,
    block], paired_scales [blocks, block, kv_heads, 2]) → [b, heads, d]."""
    b, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if group > 8 or WARP_KEYS % block_size or block_size % 16 or (tma and block_size != WARP_KEYS):
        raise ValueError(f"group {group}, block_size {block_size} not supported (TMA: 32-token blocks)")
    num_splits, out, partials = split_partials(q, tables, lens, block_size, kv_heads, num_warps * WARP_KEYS,
                                               num_splits)
    vb, vh, vd, _ = v_cache_t.stride()
    layouts = smem_layouts(d, tma)
    k_desc = v_desc = None
    if tma:  # K rows [blocks · kv_heads · 32, d] and V^T rows [blocks · kv_heads · d, 32] of head-major storage
        k_rows = k_cache.transpose(1, 2).view(-1, d)
        v_rows = v_cache_t.view(-1, block_size)
        k_desc = TensorDescriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), [32, d], layouts["K_SMEM"])
        v_desc = TensorDescriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), [d, 32], layouts["V_SMEM"])
    _warp_fp8_decode_kernel[(kv_heads, b, num_splits)](
        q, k_cache, k_desc, v_cache_t, v_desc, paired_scales, tables, lens, out, partials.acc, partials.ml,
        A._score_args(scale, None)[0], A.NO_WINDOW, num_splits, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), *k_cache.stride()[:3], vb, vh, vd, tables.stride(0), *paired_scales.stride()[:3],
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=d, SPLIT=num_splits > 1, STAGES=stages, **layouts,
        S_READ=scale_read_layout(num_warps), TMA=tma, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    return out if num_splits == 1 else A.merge_partials(partials, out)


def experiment_runs(args):
    """fp8_dot_decode.measure_points' runs: each (warps, stages, splits) of args, and with --bf16 the engine's kernel
    over a bf16 cache of the same shape and tables (twice the bytes)."""
    def runs(case, scale):
        out = []
        if args.bf16:
            out.append(bf16_run(case, scale))
        paired = interleaved_scales(case["scales"])
        for warps, stages, splits, tma, regs in itertools.product(args.warps, args.stages, args.splits or [None],
                                                                  args.tma, args.maxnreg):
            rule = {"num_warps": warps, "stages": stages, "num_splits": splits, "tma": bool(tma), "maxnreg": regs}
            out.append(("gluon-warp", rule, lambda t, r=rule: warp_decode(case["q"], case["k8"], case["v8_t"], t,
                                                                          case["lens"], scale, paired, **r), None))
        return out
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warps", nargs="+", type=int, default=[2, 1])
    p.add_argument("--stages", nargs="+", type=int, default=[2])
    p.add_argument("--splits", nargs="*", type=int, default=[], help="splits a sequence (default: the engine's rule)")
    p.add_argument("--bf16", action="store_true", help="also time the engine's kernel over a bf16 cache")
    p.add_argument("--points", nargs="*", default=[], help="MODEL:B:CONTEXT (default: fp8_dot_decode.POINTS)")
    p.add_argument("--head-major", action="store_true", help="K and V stored [blocks, kv_heads, block, d]")
    p.add_argument("--block-size", type=int, default=32, help="tokens a cache block (TMA: 32, with --head-major)")
    p.add_argument("--tma", nargs="+", type=int, default=[0, 1], help="K and V^T by TMA (a box a warp)")
    p.add_argument("--maxnreg", nargs="+", type=int, default=[0], help="a register cap (0: none)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = measure_points(args.points, experiment_runs(args), head_major=args.head_major,
                            block_size=args.block_size)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
