"""Experiment (issue 37): an fp8 decode attention in Gluon, its K/V tiles streamed into a ring of shared-memory stages
(cp.async, 16 bytes a thread) and multiplied as stored by Hopper's fp8 wgmma: no element widened in registers.

The math is fp8_dot_decode.py's (keys as the products' M, the GQA group's heads as N; q and the probabilities times
each value's scale as two e4m3 parts, x ≈ hi + lo / 16, hi and lo as one N = 16 product); V is read token-major within
each block ([blocks, kv_heads, head_dim, block_size]: an 8-bit wgmma operand is K-major). Tile t + STAGES - 1 is
copied while tile t is multiplied; block ids and scales are loaded a tile or two ahead. No window, softcap or exact
tail: the engine's kernel is timed with and without its tail beside it (and over a bf16 cache with --bf16).
Measured on an H100 (benchmarks/results/experiments/gluon_fp8_decode_*_h100.json, notes/PERF.md round 8, eighth
session): 13% / 10% faster than the engine's kernel at Qwen3-0.6B / Llama-3.1-8B b = 256, 20% at Llama b = 16 over
32k tokens, at 0.79 / 0.76 / 0.82 of the copy bandwidth (the engine's bf16 kernel: 0.98-1.02). K by TMA and the
scales copied through the ring were measured neutral (±1.5 µs) and removed (round 8, eighth and ninth sessions).

    python benchmarks/gluon_fp8_decode.py --json out.json   # GPU (Hopper, Triton with Gluon): µs a layer, error
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_dot_decode import bf16_run, measure_points, split_partials  # noqa: E402
from nanoserve.kernels import attention as A  # noqa: E402
from nanoserve.kernels import decode_split, kv_quant  # noqa: E402

N_COLS = 8  # the products' N: a GQA group's query heads, padded to wgmma's smallest N


@gluon.jit
def _tile_blocks(table, start, end, BLOCK_SIZE: gl.constexpr, N: gl.constexpr, STEP: gl.constexpr,
                 LAYOUT: gl.constexpr):
    """Block ids of N keys start, start + STEP, ... in LAYOUT (0 at or past `end`), loaded a tile or two ahead."""
    keys = start + gl.arange(0, N, LAYOUT) * STEP
    return gl.load(table + keys // BLOCK_SIZE, mask=keys < end, other=0)


@gluon.jit
def _issue_tile(k_tile, v_tile, k_ptr, v_ptr, k_blocks, v_blocks, start, end, kv_head, stride_kb, stride_kt,
                stride_kh, stride_vb, stride_vh, stride_vd, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, K2: gl.constexpr, V2: gl.constexpr):
    """cp.async of keys [start, start + BLOCK_N) into one stage, 16 bytes a copy: K rows [keys, head_dim] and V^T
    [head_dim, keys]; keys at or past `end` zero-filled (their probabilities are 0, and 0 · NaN would not be)."""
    keys = start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, K2))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, K2))
    k_at = (k_blocks.to(gl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh)[:, None]
    cp.async_copy_global_to_shared(k_tile, k_ptr + k_at + dims[None, :], mask=(keys < end)[:, None])
    v_dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(1, V2))
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, V2))
    v_at = ((v_dims * stride_vd + kv_head * stride_vh).to(gl.int64)[:, None]
            + (v_blocks.to(gl.int64) * stride_vb + cols % BLOCK_SIZE)[None, :])
    v_at = gl.max_contiguous(gl.multiple_of(v_at, [1, 16]), [1, 16])  # each block's run of keys, as copied
    v_ok = gl.max_constancy((start + (cols // BLOCK_SIZE) * BLOCK_SIZE < end)[None, :], [1, 16])
    cp.async_copy_global_to_shared(v_tile, v_ptr + v_at, mask=v_ok)


@gluon.jit
def _tile_scales(ks_ptr, vs_ptr, blocks, start, end, kv_head, stride_sb, stride_st, stride_sh,
                 BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr):
    """Per-token K and V scales of keys [start, start + BLOCK_N) in the scores' row layout (0 past `end`), as stored:
    loaded a tile ahead and widened where used (widening and reducing them where loaded waited on the load: 32% of
    the stall samples)."""
    keys = start + gl.arange(0, BLOCK_N, ROWS)
    ok = keys < end
    at = blocks.to(gl.int64) * stride_sb + (keys % BLOCK_SIZE) * stride_st + kv_head * stride_sh
    return gl.load(ks_ptr + at, mask=ok, other=0.0), gl.load(vs_ptr + at, mask=ok, other=0.0)


@gluon.jit
def _split8(x):
    """fp32 x within ±448 → (hi, lo) e4m3 with x ≈ hi + lo / 16; hi rounded in fp32 (kv_quant.e4m3_nearest), not
    read back from its codes (Triton 3.6's e4m3 → fp32 conversion here swapped elements pairwise on the H100: lo came
    out ±448)."""
    hi = kv_quant.e4m3_nearest(x)
    return hi.to(gl.float8e4nv), ((x - hi) * 16.0).to(gl.float8e4nv)


@gluon.jit
def _load_q(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
            Q_LAYOUT: gl.constexpr, Q_SMEM: gl.constexpr, COLS: gl.constexpr):
    """The group's query rows as two e4m3 parts in shared memory ([16, head_dim]: rows 0-7 the hi parts, 8-15 the
    lo parts, rows past the group zero) and each row's scale in the scores' column layout."""
    rows = gl.arange(0, 8, gl.SliceLayout(1, Q_LAYOUT))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, Q_LAYOUT))
    q = gl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :],
                mask=(rows < GROUP)[:, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(q), 1)
    scale = gl.where(amax > 0, amax / 448.0, 1.0)
    hi, lo = _split8(q / scale[:, None])
    q16 = gl.allocate_shared_memory(gl.float8e4nv, [16, HEAD_DIM], Q_SMEM)
    q16.slice(0, 8, 0).store(hi)
    q16.slice(8, 8, 0).store(lo)
    return q16, gl.convert_layout(scale, COLS)


@gluon.jit
def _halves(x, LAYOUT: gl.constexpr):
    """[R, 16] → its columns 0-7 and 8-15, each [R, 8] in LAYOUT (an N = 16 product's hi and lo halves)."""
    R: gl.constexpr = x.shape[0]
    a, b = gl.split(gl.permute(gl.reshape(x, [R, 2, 8]), (0, 2, 1)))
    return gl.convert_layout(a, LAYOUT), gl.convert_layout(b, LAYOUT)


@gluon.jit
def _twice(f, LAYOUT: gl.constexpr):
    """[8] → [16]: f then f again, in LAYOUT (a per-column factor for both halves of an N = 16 product)."""
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(f, f), (1, 0)), [16]), LAYOUT)


@gluon.jit
def _program_keys(lens_ptr, window, num_splits, BLOCK_N: gl.constexpr):
    """(kv head, sequence, split, first key, end key) of this program of a (kv heads, sequences, splits) grid: the
    split's keys by decode_split.decode_partition (an empty split has first key > end key, or = for a split starting
    at the context's end, which writes an empty partial). Shared by both Gluon experiments."""
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    split = gl.program_id(2)
    _, first_tile, partition, context_len = decode_split.decode_partition(gl.load(lens_ptr + seq), window, num_splits,
                                                                          BLOCK_N)
    part_start = first_tile + split * partition
    return kv_head, seq, split, part_start, gl.minimum(part_start + partition, context_len)


@gluon.jit
def _gluon_fp8_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                             window, num_splits, stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_kt,
                             stride_kh, stride_vb, stride_vh, stride_vd, stride_bt, ks_ptr, vs_ptr, stride_sb,
                             stride_st, stride_sh, BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr,
                             HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, Q_SMEM: gl.constexpr,
                             P_SMEM: gl.constexpr, num_warps: gl.constexpr):
    """Split-K decode over an fp8 cache with per-token scales (_decode_kernel's partials; the grid is (kv heads,
    sequences, splits): a sequence's kv heads in consecutive programs read whole blocks together, 2-3% faster than
    sequences first): scores [keys, heads] = K · q^T and output^T [head_dim, heads] += V^T · p^T, each one wgmma
    e4m3 × e4m3 → fp32 of N = 16 (the 8 columns' hi parts, then their lo parts)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 8, 32])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 16, 32])
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    # The copies' layouts: 16 bytes a thread along head_dim (K) and along each block's keys (V^T)
    K2: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (HEAD_DIM // 16), HEAD_DIM // 16], [num_warps, 1], [1, 0])
    V2: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_N // 16), BLOCK_N // 16], [num_warps, 1], [1, 0])
    KB: gl.constexpr = gl.SliceLayout(1, K2)
    VB: gl.constexpr = gl.SliceLayout(0, V2)
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    kv_head, seq, split, part_start, part_end = _program_keys(lens_ptr, window, num_splits, BLOCK_N)
    if part_start <= part_end:  # an empty partition writes an empty partial (the reduce ignores it)
        table = tables_ptr + seq.to(gl.int64) * stride_bt
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N], V_SMEM)
        p16 = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_N], P_SMEM)
        for s in gl.static_range(STAGES - 1):
            first = part_start + s * BLOCK_N
            _issue_tile(k_smem.index(s), v_smem.index(s), k_ptr, v_ptr,
                        _tile_blocks(table, first, part_end, BLOCK_SIZE, BLOCK_N, 1, KB),
                        _tile_blocks(table, first, part_end, BLOCK_SIZE, BLOCK_N, 1, VB), first, part_end,
                        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, BLOCK_SIZE,
                        BLOCK_N, HEAD_DIM, K2, V2)
            cp.commit_group()
        first = part_start + (STAGES - 1) * BLOCK_N
        k_blocks = _tile_blocks(table, first, part_end, BLOCK_SIZE, BLOCK_N, 1, KB)
        v_blocks = _tile_blocks(table, first, part_end, BLOCK_SIZE, BLOCK_N, 1, VB)
        q16, q_scale = _load_q(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, HEAD_DIM, Q_LAYOUT, Q_SMEM, COLS)
        col_scale = q_scale * qk_scale
        m_i = gl.full([8], float("-inf"), gl.float32, COLS)
        l_rows = gl.zeros([BLOCK_N, 8], gl.float32, MMA)  # per-key sums, reduced once at the end
        unit = gl.full([8], 1.0, gl.float32, COLS)  # acc16 holds the output times `unit` (the last tile's w_mul)
        acc16 = gl.zeros([HEAD_DIM, 16], gl.float32, MMA16)
        s_zero = gl.zeros([BLOCK_N, 16], gl.float32, MMA16)
        k_scale, v_scale = _tile_scales(ks_ptr, vs_ptr,
                                        _tile_blocks(table, part_start, part_end, BLOCK_SIZE, BLOCK_N, 1, ROWS),
                                        part_start, part_end, kv_head, stride_sb, stride_st, stride_sh, BLOCK_SIZE,
                                        BLOCK_N, ROWS)
        r_blocks = _tile_blocks(table, part_start + BLOCK_N, part_end, BLOCK_SIZE, BLOCK_N, 1, ROWS)
        for t in range(gl.cdiv(part_end - part_start, BLOCK_N)):
            start = part_start + t * BLOCK_N
            ahead = (t + STAGES - 1) % STAGES
            issue = start + (STAGES - 1) * BLOCK_N
            _issue_tile(k_smem.index(ahead), v_smem.index(ahead), k_ptr, v_ptr, k_blocks, v_blocks, issue, part_end,
                        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, BLOCK_SIZE,
                        BLOCK_N, HEAD_DIM, K2, V2)
            cp.commit_group()
            k_blocks = _tile_blocks(table, issue + BLOCK_N, part_end, BLOCK_SIZE, BLOCK_N, 1, KB)
            v_blocks = _tile_blocks(table, issue + BLOCK_N, part_end, BLOCK_SIZE, BLOCK_N, 1, VB)
            k_next, v_next = _tile_scales(ks_ptr, vs_ptr, r_blocks, start + BLOCK_N, part_end, kv_head, stride_sb,
                                          stride_st, stride_sh, BLOCK_SIZE, BLOCK_N, ROWS)
            r_blocks = _tile_blocks(table, start + 2 * BLOCK_N, part_end, BLOCK_SIZE, BLOCK_N, 1, ROWS)
            stage = t % STAGES
            cp.wait_group(STAGES - 1)
            fence_async_shared()
            gl.thread_barrier()
            s_hi, s_lo = _halves(warpgroup_mma(k_smem.index(stage), q16.permute((1, 0)), s_zero, use_acc=False), MMA)
            keys = start + gl.arange(0, BLOCK_N, ROWS)
            scores = (s_hi + s_lo * 0.0625) * col_scale[None, :] * k_scale.to(gl.float32)[:, None]
            scores = gl.where((keys < part_end)[:, None], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(scores - m_new[None, :])
            l_rows = l_rows * alpha[None, :] + p
            v_wide = v_scale.to(gl.float32)
            v_max = gl.max(v_wide, 0)
            w_mul = gl.where(v_max > 0, 448.0 / v_max, 1.0)  # p ≤ 1: p · v_scale · w_mul within e4m3's range
            w_hi, w_lo = _split8(p * (v_wide * w_mul)[:, None])
            p16.slice(0, 8, 0).store(gl.permute(w_hi, (1, 0)))
            p16.slice(8, 8, 0).store(gl.permute(w_lo, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            factor = alpha * (w_mul / unit)
            unit = gl.zeros([8], gl.float32, COLS) + w_mul
            acc16 = warpgroup_mma(v_smem.index(stage), p16.permute((1, 0)),
                                  acc16 * _twice(factor, gl.SliceLayout(0, MMA16))[None, :])
            m_i = m_new
            k_scale = k_next
            v_scale = v_next
        cp.wait_group(0)
        l_i = gl.sum(l_rows, 0)
        acc_hi, acc_lo = _halves(acc16, MMA)
        acc = (acc_hi + acc_lo * 0.0625) / unit[None, :]
        dims = gl.arange(0, HEAD_DIM, ROWS)
        cols = gl.arange(0, 8, COLS)
        heads = kv_head * GROUP + cols
        col_ok = (cols < GROUP)[None, :] & (dims < HEAD_DIM)[:, None]
        if SPLIT:
            part = (seq * (gl.num_programs(0) * GROUP) + heads).to(gl.int64) * num_splits + split
            gl.store(part_acc_ptr + part[None, :] * HEAD_DIM + dims[:, None], acc, mask=col_ok)
            gl.store(part_ml_ptr + part * 2, m_i, mask=cols < GROUP)
            gl.store(part_ml_ptr + part * 2 + 1, l_i, mask=cols < GROUP)
        else:
            out = acc / gl.where(l_i > 0, l_i, 1.0)[None, :]
            gl.store(out_ptr + seq * stride_ob + heads[None, :] * stride_oh + dims[:, None],
                     out.to(out_ptr.dtype.element_ty), mask=col_ok)


def _swizzle(row_bytes: int) -> int:
    return next((w for w in (128, 64, 32) if row_bytes % w == 0), 0)


def smem_layouts(block_n: int, head_dim: int) -> dict:
    """The kernel's shared-memory layouts (constexpr arguments), each swizzled by its row's bytes as wgmma reads it:
    K stages [keys, head_dim], V^T stages [head_dim, keys] (Triton 3.6 finds no wgmma layout for an unswizzled 8-bit
    operand; each block's 16-byte run of keys lands at its swizzled place), q and p^T [16, rows]."""
    nvmma = gl.NVMMASharedLayout
    return {"K_SMEM": nvmma(swizzle_byte_width=_swizzle(head_dim), element_bitwidth=8, rank=2),
            "V_SMEM": nvmma(swizzle_byte_width=_swizzle(block_n), element_bitwidth=8, rank=2),
            "Q_SMEM": nvmma(swizzle_byte_width=_swizzle(head_dim), element_bitwidth=8, rank=2),
            "P_SMEM": nvmma(swizzle_byte_width=_swizzle(block_n), element_bitwidth=8, rank=2)}


def gluon_decode(q, k_cache, v_cache_t, tables, lens, scale, kv_scales, *, block_n=64, stages=2, num_splits=None):
    """q [b, heads, d] bf16 over an fp8 cache (k_cache [blocks, block, kv_heads, d], v_cache_t [blocks, kv_heads, d,
    block]) with per-token scales → [b, heads, d]."""
    b, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if group > N_COLS or block_n % block_size or block_size % 16:
        raise ValueError(f"group {group}, block_n {block_n}, block_size {block_size} not supported")
    ks, vs = kv_scales
    num_splits, out, partials = split_partials(q, tables, lens, block_size, kv_heads, block_n, num_splits)
    vb, vh, vd, _ = v_cache_t.stride()
    layouts = smem_layouts(block_n, d)
    _gluon_fp8_decode_kernel[(kv_heads, b, num_splits)](
        q, k_cache, v_cache_t, tables, lens, out, partials.acc, partials.ml, A._score_args(scale, None)[0],
        A.NO_WINDOW, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], vb,
        vh, vd, tables.stride(0), ks, vs, *kv_quant.scale_strides(ks), BLOCK_SIZE=block_size, GROUP=group,
        HEAD_DIM=d, SPLIT=num_splits > 1, BLOCK_N=block_n, STAGES=stages, **layouts, num_warps=4)
    return out if num_splits == 1 else A.merge_partials(partials, out)


def experiment_runs(args):
    """fp8_dot_decode.measure_points' runs for this kernel: each (block_n, stages, splits) of args, and with --bf16
    the engine's kernel over a bf16 cache of the same shape and tables (twice the bytes)."""
    def runs(case, scale):
        out = []
        if args.bf16:
            out.append(bf16_run(case, scale))
        for bn, stages, splits in itertools.product(args.block_n, args.stages, args.splits or [None]):
            rule = {"block_n": bn, "stages": stages, "num_splits": splits}
            out.append(("gluon", rule, lambda t, r=rule: gluon_decode(case["q"], case["k8"], case["v8_t"], t,
                                                                      case["lens"], scale, case["scales"], **r),
                        None))
        return out
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-n", nargs="+", type=int, default=[64])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    p.add_argument("--splits", nargs="*", type=int, default=[], help="splits a sequence (default: the engine's rule)")
    p.add_argument("--bf16", action="store_true", help="also time the engine's kernel over a bf16 cache")
    p.add_argument("--points", nargs="*", default=[], help="MODEL:B:CONTEXT (default: fp8_dot_decode.POINTS)")
    p.add_argument("--head-major", action="store_true", help="K and V stored [blocks, kv_heads, block, d]")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = measure_points(args.points, experiment_runs(args), head_major=args.head_major)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
