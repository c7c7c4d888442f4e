"""The MoE kernels' tile choices, measured: each candidate tiling of kernels/moe.py's two paths timed on one real
layer inside a CUDA graph, as the engine replays them: Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8, bf16) or
Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2; its gemv path at T = 1 only: the b = 1 target).

    python benchmarks/moe_tiles.py [--shape qwen3|mixtral] [--only gemv|grouped] [--out DIR]

gemv path (decode, T = 1 and 8 tokens): BLOCK_N × BLOCK_K × warps of the gate/up kernel (down at its default), then
of the down kernel (gate/up at its default); the routed block (routing inside both kernels) is what is timed.
grouped path (T = 64, 512, 8192 tokens): block_m × block_n × block_k × warps × stages, shared by both products.
Every candidate's output is checked against the default tiling's (a tiling that computes something else is an
error, not a result). The defaults in kernels/moe.py / moe_gemm.py are then set from the JSON this writes.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, env_info, write_json  # noqa: E402
from benchmarks.decode_floor import graph_ms  # noqa: E402

SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}  # H, I, E, k
H, I, E, K = SHAPES["qwen3"]
REPEAT = 20  # block calls per graph, so launch gaps between replays do not count


def graph_us(fn) -> float:
    """µs per call of fn, replayed REPEAT times inside one CUDA graph (decode_floor.graph_ms, the shared timing)."""
    return 1e3 * graph_ms(fn, calls=REPEAT)


def inputs(tokens: int):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    logits = torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, logits, w13, w2


def sweep_gemv(moe) -> dict:
    default = moe._gemv_tiles
    out = {}
    candidates = [(n, k, w) for n, k, w in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024), (4, 8))
                  if 2 * K * n * k <= 256 * 32 * w]  # fp32 accumulators a thread holds (gate and up): 256 spill
    for tokens in ((1, 8) if E > 8 else (1,)):
        x, logits, w13, w2 = inputs(tokens)
        want = moe.routed_gemv_experts(x, logits, w13, w2, K, True)
        base = graph_us(lambda: moe.routed_gemv_experts(x, logits, w13, w2, K, True))
        rec = {"default_us": base, "gate_up": [], "down": []}
        for which, n in (("gate_up", I), ("down", H)):
            for block_n, block_k, warps in candidates:
                def tiles(programs, cols, top_k, device, gated, n=n, cfg=(block_n, block_k, warps)):
                    return cfg if cols == n else default(programs, cols, top_k, device, gated)
                moe._gemv_tiles = tiles
                try:
                    got = moe.routed_gemv_experts(x, logits, w13, w2, K, True)
                    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
                    us = graph_us(lambda: moe.routed_gemv_experts(x, logits, w13, w2, K, True))
                except Exception as e:  # a tiling Triton refuses (registers, shared memory) is a result too
                    rec[which].append({"tiles": [block_n, block_k, warps], "error": f"{type(e).__name__}"})
                    continue
                finally:
                    moe._gemv_tiles = default
                rec[which].append({"tiles": [block_n, block_k, warps], "us": us})
            best = min((r for r in rec[which] if "us" in r), key=lambda r: r["us"])
            print(f"gemv T={tokens} {which}: default {base:.1f} us, best {best['us']:.1f} us at {best['tiles']}",
                  flush=True)
        out[str(tokens)] = rec
    return out


def sweep_grouped(moe, moe_gemm) -> dict:
    default = moe.grouped_tiles
    out = {}
    small = [moe_gemm.GroupedTiles(16, n, k, w, s) for n, k, w, s in
             itertools.product((32, 64, 128), (64, 128, 256), (4,), (3, 4))]
    large = [moe_gemm.GroupedTiles(m, n, k, w, s, g) for m, n, k, w, s, g in
             itertools.product((64, 128), (64, 128), (64,), (4, 8), (3, 4), (8,))]
    for tokens, candidates in ((64, small), (512, small + large[:8]), (8192, large)):
        x, logits, w13, w2 = inputs(tokens)
        weights, ids = moe.route(logits, K, True)
        want = moe.grouped_experts(x, w13, w2, weights, ids)
        base = graph_us(lambda: moe.grouped_experts(x, w13, w2, weights, ids))
        rec = {"default_us": base, "candidates": []}
        for tiles in candidates:
            def pick(pairs_per_expert, n, k, dtype, device, t=tiles):
                return moe_gemm.GroupedTiles(t.block_m, min(t.block_n, n), min(t.block_k, k), t.num_warps,
                                             t.num_stages, t.group_m)
            moe.grouped_tiles = pick
            try:
                got = moe.grouped_experts(x, w13, w2, weights, ids)
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
                us = graph_us(lambda: moe.grouped_experts(x, w13, w2, weights, ids))
            except Exception as e:
                rec["candidates"].append({"tiles": list(vars(tiles).values()), "error": f"{type(e).__name__}"})
                continue
            finally:
                moe.grouped_tiles = default
            rec["candidates"].append({"tiles": list(vars(tiles).values()), "us": us})
        best = min((r for r in rec["candidates"] if "us" in r), key=lambda r: r["us"])
        flops = 2 * tokens * K * 3 * H * I
        print(f"grouped T={tokens}: default {base:.1f} us, best {best['us']:.1f} us at {best['tiles']} "
              f"({flops / best['us'] / 1e6:.0f} TFLOP/s for the whole block)", flush=True)
        out[str(tokens)] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--only", choices=("gemv", "grouped"))
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3")
    args = p.parse_args(argv)
    global H, I, E, K
    H, I, E, K = SHAPES[args.shape]
    if not torch.cuda.is_available():
        print("moe_tiles.py needs a CUDA GPU")
        return 0
    from nanoserve.kernels import moe, moe_gemm

    report = {"env": env_info(), "shape": {"hidden": H, "moe_intermediate": I, "experts": E, "top_k": K}}
    if args.only != "grouped":
        report["gemv"] = sweep_gemv(moe)
    if args.only != "gemv":
        report["grouped"] = sweep_grouped(moe, moe_gemm)
    name = "moe_tiles.json" if args.shape == "qwen3" else f"moe_tiles_{args.shape}.json"
    print(f"wrote {write_json(args.out / name, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
