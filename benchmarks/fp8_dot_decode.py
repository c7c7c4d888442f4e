"""Experiment (issue 37): fp8 decode attention whose products run on Hopper's fp8 tensor cores, against the engine's.

The engine's fp8 decode widens every K/V element to fp16 in registers before its tensor-core products, so its time
follows the elements it handles, not their bytes (notes/PERF.md, round 8). Here the codes go to tl.dot as stored
(e4m3 × e4m3 → fp32 wgmma): q is split into two e4m3 parts, q ≈ s·(hi + lo / 16) (about bf16's precision), and so
are the probabilities times each value's scale, per row scaled to e4m3's range; the per-element work moves from the
[keys, head_dim] tiles to the [keys, heads] scores. The keys are the products' M (wgmma needs 64 rows; with the 16
query rows as M Triton converts every element to fp16 for mma.sync instead), so V is read token-major within each
block ([blocks, kv_heads, head_dim, block_size]: 8-bit wgmma operands must be K-major; dim-major V, transposed by
Triton 3.6, faulted on the H100). Measured on an H100 (benchmarks/results/experiments/fp8_dot_decode_*_h100.json):
1.6× slower than the engine's kernel at Qwen3-0.6B b = 256 (208-218 µs a layer against 131), with or without the
lo parts, so the cost is the structure Triton gives it (per-tile reductions across the warps that share the keys,
synchronous wgmma waits, the probabilities staged through shared memory), not the split products.

    python benchmarks/fp8_dot_decode.py --json out.json      # GPU: µs a layer and error against fp32, both kernels
    TRITON_INTERPRET=1 python benchmarks/fp8_dot_decode.py --check   # CPU: the kernel against the oracle
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nanoserve.kernels import attention as A  # noqa: E402
from nanoserve.kernels import decode_split, kv_quant  # noqa: E402
from nanoserve.kernels import reference as torch_ref  # noqa: E402
from nanoserve.kernels.kv_quant import fp8_codes  # noqa: E402

FP8 = tl.float8e4nv


@triton.jit
def _split8(x, UPCAST: tl.constexpr):
    """fp32 x [R, C] already within ±448 → (hi, lo) e4m3 with x ≈ hi + lo / 16. The interpreter's own conversion
    does not round to nearest even: there the values are rounded first (kv_quant.fp8_codes), as the GPU's cvt does."""
    if UPCAST:
        hi = fp8_codes(x, 1.0)
        lo = fp8_codes((x - hi) * 16.0, 1.0)
        return hi.to(FP8), lo.to(FP8)
    hi = x.to(FP8)
    lo = ((x - hi.to(tl.float32)) * 16.0).to(FP8)
    return hi, lo


@triton.jit
def _dot8(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter: products in fp32 of the e4m3 values
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _token_major_tile(v_ptr, table, start, end, kv_head, dims, stride_vb, stride_vh, stride_vd,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """V^T [D, BLOCK_N] of keys [start, start + BLOCK_N) from a token-major cache ([blocks, kv_heads, D, block_size]),
    loaded as [D, blocks, block_size] so each block's run of keys is one vectorized load; keys past `end` zeroed."""
    NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
    first = start // BLOCK_SIZE + tl.arange(0, NB)
    offsets = tl.arange(0, BLOCK_SIZE)
    block_ok = first * BLOCK_SIZE < end
    block_ids = tl.load(table + first, mask=block_ok, other=0).to(tl.int64)
    v = tl.load(v_ptr + block_ids[None, :, None] * stride_vb + kv_head * stride_vh + dims[:, None, None] * stride_vd
                + offsets[None, None, :], mask=block_ok[None, :, None], other=0.0)
    keys = first[:, None] * BLOCK_SIZE + offsets[None, :]
    v = tl.where((keys < end)[None, :, :], v, 0.0)
    return tl.reshape(v, [v.shape[0], BLOCK_N])


@triton.jit
def _dot8_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                      window, num_splits, stride_qb, stride_qh, stride_ob, stride_oh,
                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_bt,
                      ks_ptr, vs_ptr, stride_sb, stride_st, stride_sh,
                      BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, Q_LO: tl.constexpr, P_LO: tl.constexpr,
                      V_TOKEN_MAJOR: tl.constexpr, UPCAST: tl.constexpr):
    """Split-K decode over an fp8 cache (_decode_kernel's grid and partials, no window / softcap / tail) with the keys
    as the products' M (64 or more rows: Hopper's fp8 wgmma; with the query heads as M, 16 rows, Triton widens every
    element to fp16 for mma.sync, as the engine's kernel does) and the query heads as N: scores are [keys, heads],
    the output [head_dim, heads]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    _, first_tile, partition, context_len = decode_split.decode_partition(tl.load(lens_ptr + seq), window, num_splits,
                                                                          BLOCK_N)
    part_start = first_tile + split * partition
    if part_start <= context_len:
        part_end = tl.minimum(part_start + partition, context_len)
        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        q = tl.load(q_ptr + seq * stride_qb + heads[None, :] * stride_qh + dims[:, None], mask=row_ok[None, :],
                    other=0.0).to(tl.float32)  # [D, G]
        q_scale = tl.max(tl.abs(q), 0) / 448.0
        q_scale = tl.where(q_scale > 0, q_scale, 1.0)
        q_hi, q_lo = _split8(q / q_scale[None, :], UPCAST)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([HEAD_DIM, BLOCK_G], tl.float32)
        table = tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(part_start, part_end, BLOCK_N):
            keys = tl.multiple_of(start, BLOCK_N) + tl.arange(0, BLOCK_N)
            key_ok = keys < part_end
            offsets = keys % BLOCK_SIZE
            block_ids = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            k = tl.load(k_ptr + block_ids[:, None] * stride_kb + offsets[:, None] * stride_kt + kv_head * stride_kh
                        + dims[None, :], mask=key_ok[:, None], other=0.0)
            dots = _dot8(k, q_hi, UPCAST)  # [N, G]
            if Q_LO:
                dots += _dot8(k, q_lo, UPCAST) * (1.0 / 16.0)
            scale_at = block_ids * stride_sb + offsets * stride_st + kv_head * stride_sh
            k_scale = tl.load(ks_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)
            v_scale = tl.load(vs_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)
            scores = dots * (q_scale[None, :] * qk_scale) * k_scale[:, None]
            scores = tl.where(key_ok[:, None], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            w = p * v_scale[:, None]
            w_max = tl.max(w, 0)
            w_mul = tl.where(w_max > 0, 448.0 / w_max, 1.0)
            w_hi, w_lo = _split8(w * w_mul[None, :], UPCAST)
            if V_TOKEN_MAJOR:  # [D, keys]: keys contiguous within each block, loaded as [D, blocks, block_size]
                v_t = _token_major_tile(v_ptr, table, start, part_end, kv_head, dims, stride_vb, stride_vh, stride_vd,
                                        BLOCK_SIZE, BLOCK_N)
            else:
                v_t = tl.trans(tl.load(v_ptr + block_ids[:, None] * stride_vb + offsets[:, None] * stride_vt
                                       + kv_head * stride_vh + dims[None, :] * stride_vd, mask=key_ok[:, None],
                                       other=0.0))
            pv = _dot8(v_t, w_hi, UPCAST)  # [D, G]
            if P_LO:
                pv += _dot8(v_t, w_lo, UPCAST) * (1.0 / 16.0)
            acc = acc * alpha[None, :] + pv / w_mul[None, :]
            m_i = m_new
        if not SPLIT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
            tl.store(out_ptr + seq * stride_ob + heads[None, :] * stride_oh + dims[:, None],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
        else:
            part = (seq * (tl.num_programs(1) * GROUP) + heads).to(tl.int64) * num_splits + split
            tl.store(part_acc_ptr + part[None, :] * HEAD_DIM + dims[:, None], acc, mask=row_ok[None, :])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


def split_partials(q, tables, lens, block_size, kv_heads, block_n, num_splits=None):
    """(num_splits, out, partials) of one experimental decode call: the engine's split rule (attention.decode_splits,
    a CPU counting as 132 SMs), and the output and DecodePartials it writes: dot8_decode's host prologue."""
    b, heads, d = q.shape
    max_keys = tables.shape[1] * block_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count if q.is_cuda else 132
    num_splits = A.decode_splits(num_splits, b, kv_heads, max_keys, block_n, sms)
    parts = torch.empty(b * heads * num_splits * (d + 2), dtype=torch.float32, device=q.device)
    partials = A.DecodePartials(parts[:b * heads * num_splits * d], parts[b * heads * num_splits * d:], lens,
                                A.NO_WINDOW, b, heads, d, num_splits, block_n, q.dtype)
    return num_splits, torch.empty_like(q), partials


def dot8_decode(q, k_cache, v_cache, tables, lens, scale, kv_scales, *, v_token_major: bool, q_lo=True, p_lo=True,
                block_n=64, num_warps=4, num_stages=1, num_splits=None):
    """The experiment's decode: q [b, heads, d] bf16 over an fp8 cache (v_cache [blocks, block, kv_heads, d], or with
    v_token_major a [blocks, kv_heads, d, block] tensor) with per-token scales → [b, heads, d]."""
    b, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if v_token_major:
        vb, vh, vd, vt = v_cache.stride()
    else:
        vb, vt, vh, vd = v_cache.stride()
    ks, vs = kv_scales
    num_splits, out, partials = split_partials(q, tables, lens, block_size, kv_heads, block_n, num_splits)
    _dot8_decode_kernel[(b, kv_heads, num_splits)](
        q, k_cache, v_cache, tables, lens, out, partials.acc, partials.ml, A._score_args(scale, None)[0], A.NO_WINDOW,
        num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], vb, vt, vh, vd,
        tables.stride(0), ks, vs, *kv_quant.scale_strides(ks),
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=d, SPLIT=num_splits > 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, Q_LO=q_lo, P_LO=p_lo,
        V_TOKEN_MAJOR=v_token_major, UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps, num_stages=num_stages)
    return out if num_splits == 1 else A.merge_partials(partials, out)


def make_case(b, heads, kv_heads, d, context, layers, device, block=16, seed=0):
    """`layers` fp8 caches (codes + per-token scales, each layer its own blocks) and their tables, q, and the
    token-major copy of V."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = b * (context // block)
    k = torch.randn(layers * blocks, block, kv_heads, d, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(layers * blocks, block, kv_heads, d, generator=g, device=device).to(torch.bfloat16)
    (k8, ks), (v8, vs) = (kv_quant.quantize_ref(x) for x in (k, v))
    v8_t = v8.permute(0, 2, 3, 1).contiguous()  # [blocks, kv_heads, d, block]
    perm = torch.randperm(blocks, generator=g, device=device).to(torch.int32)
    tables = [(layer * blocks + perm).view(b, -1).contiguous() for layer in range(layers)]
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    q = torch.randn(b, heads, d, generator=g, device=device).to(torch.bfloat16)
    return {"q": q, "k8": k8, "v8": v8, "v8_t": v8_t, "scales": (ks, vs), "tables": tables, "lens": lens}


def oracle(case, layer=0):
    """fp32 attention over the dequantized cache of one layer (kernels/reference.py's, fed q in fp32)."""
    return torch_ref.decode_attention(case["q"].float(), case["k8"], case["v8"], case["tables"][layer], case["lens"],
                                      case["q"].shape[-1] ** -0.5, kv_scales=case["scales"])


def variants(args):
    for tm, qlo, plo, bn, warps, stages in itertools.product(args.v_layouts, args.q_lo, args.p_lo, args.block_n,
                                                              args.warps, args.stages):
        yield {"v_token_major": tm == "token", "q_lo": bool(qlo), "p_lo": bool(plo), "block_n": bn,
               "num_warps": warps, "num_stages": stages}


def run_variant(case, scale, rule):
    v = case["v8_t"] if rule["v_token_major"] else case["v8"]
    return lambda t: dot8_decode(case["q"], case["k8"], v, t, case["lens"], scale, case["scales"], **rule)


def engine_kernel(case, scale, tail):
    extra = {}
    if tail:  # (CUDA only: the benchmark's)
        b, _, d = case["q"].shape
        kv_heads = case["k8"].shape[2]
        rows = b * kv_quant.TAIL_BANKS * case["k8"].shape[1]
        extra = {"kv_tail": tuple(torch.zeros(rows, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                                  for _ in range(2)),
                 "slots": torch.arange(b, device="cuda", dtype=torch.int32)}
    return lambda t: A.decode_attention(case["q"], case["k8"], case["v8"], t, case["lens"], scale,
                                        kv_scales=case["scales"], **extra)


def time_layers(fn, tables):
    """µs a layer: every layer's call captured in one CUDA graph, replayed back to back (decode_floor.graph_ms)."""
    from decode_floor import graph_ms

    return graph_ms(lambda: [fn(t) for t in tables], calls=1) * 1e3 / len(tables)


SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128),
          "d64": (16, 8, 64)}  # (heads, kv heads, head_dim); d64: a bf16 row of an fp8 d = 128 row's bytes
POINTS = [("qwen3-0.6b", 256, 512), ("qwen3-0.6b", 64, 512), ("qwen3-0.6b", 1, 512), ("llama-3.1-8b", 64, 512),
          ("llama-3.1-8b", 256, 512), ("llama-3.1-8b", 16, 32768), ("llama-3.1-8b", 1, 512)]


def measure(args) -> dict:
    return measure_points(args.points, lambda case, scale: [("dot8", rule, run_variant(case, scale, rule), None)
                                                            for rule in variants(args)])


def measure_points(points: list[str], experiment_runs, device: str = "cuda") -> dict:
    """µs a layer (every layer's call in one graph) and the fraction of the copy bandwidth of the engine's kernel
    (without and with its tail) and of experiment_runs(case, scale) → [(kernel, rule, fn(table), bytes a layer or
    None for the fp8 cache's)] at `points` ("MODEL:B:CONTEXT", a model of SHAPES; default POINTS), with each run's
    largest error against the fp32 oracle where the oracle fits."""
    from common import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth": bandwidth, "points": []}
    for name, b, context in [(m, int(b), int(c)) for m, b, c in (pt.split(":") for pt in points)] or POINTS:
        heads, kv_heads, d = SHAPES[name]
        bytes_layer = b * context * kv_heads * (2 * d + 2 * 2)
        layers = max(2, min(16, -(-(512 << 20) // bytes_layer)))
        case = make_case(b, heads, kv_heads, d, context, layers, device)
        scale = d ** -0.5
        ref = oracle(case) if b * context <= 64 * 512 else None
        runs = [("engine", {"tail": t}, engine_kernel(case, scale, bool(t)), None) for t in (0, 1)]
        for kernel, rule, fn, moved in runs + experiment_runs(case, scale):
            rec = {"model": name, "b": b, "context": context, "kernel": kernel, **rule}
            try:
                if ref is not None and not rule.get("tail") and moved is None:
                    err = (fn(case["tables"][0]).float() - ref).abs()
                    rec["max_abs_err"], rec["mean_abs_err"] = err.max().item(), err.mean().item()
                rec["us_per_layer"] = time_layers(fn, case["tables"])
                rec["bandwidth_fraction"] = (moved or bytes_layer) / (rec["us_per_layer"] * 1e-6) / bandwidth
            except Exception as exc:  # a variant that does not compile is a result too
                rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
            report["points"].append(rec)
            print(json.dumps(rec), flush=True)
        del case
        torch.cuda.empty_cache()
    return report


CHECK_TOLERANCE = 1.5  # times the engine kernel's largest error on the same case (both round the output to bf16)


def check_errors() -> dict[str, float]:
    """The kernel's largest error against the fp32 oracle on a small case (three sequences, one of one token), for
    each V layout and split count, and the engine's kernel's ("engine"): in the interpreter off CUDA
    (TRITON_INTERPRET=1)."""
    case = make_case(3, 4, 2, 32, 160, 1, "cpu", block=16, seed=1)
    case["lens"] = torch.tensor([160, 37, 1], dtype=torch.int32)
    ref = oracle(case)
    errors = {"engine": (engine_kernel(case, 32 ** -0.5, False)(case["tables"][0]).float() - ref).abs().max().item()}
    for tm, split in itertools.product([False, True], [1, 3]):
        v = case["v8_t"] if tm else case["v8"]
        out = dot8_decode(case["q"], case["k8"], v, case["tables"][0], case["lens"], 32 ** -0.5, case["scales"],
                          v_token_major=tm, num_splits=split)
        errors[f"{'token' if tm else 'dim'}-major V, {split} splits"] = (out.float() - ref).abs().max().item()
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--v-layouts", nargs="+", default=["token"], choices=["dim", "token"])
    p.add_argument("--q-lo", nargs="+", type=int, default=[1])
    p.add_argument("--p-lo", nargs="+", type=int, default=[1])
    p.add_argument("--block-n", nargs="+", type=int, default=[64])
    p.add_argument("--warps", nargs="+", type=int, default=[4])
    p.add_argument("--stages", nargs="+", type=int, default=[1])
    p.add_argument("--points", nargs="*", default=[], help="MODEL:B:CONTEXT (default: POINTS)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.check:
        errors = check_errors()
        print("\n".join(f"{k}: max |err| {v:.2e}" for k, v in errors.items()))
        return int(max(errors.values()) > CHECK_TOLERANCE * errors["engine"])
    report = measure(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
