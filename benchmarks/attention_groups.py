"""Decode attention over verification rows (issue 38): a sequence's k + 1 rows read as one group
(kernels/attention.decode_attention's seq_rows) against row by row, and what the grouped kernel's wider query tile
costs plain decode rows (before Kind.VERIFY, an engine that speculated read plain rows with seq_rows = 1 + k too), per query tile
(attention.DECODE_GROUP_TILE: 16 reads Llama's 5 rows x 4 heads in chunks of 4 rows) and warp count.

    python benchmarks/attention_groups.py [--heads 32 8 128] [--context 512] [--json FILE]

Each case: `layers` distinct bf16 caches (so the keys come from HBM, not L2) read in turn by one CUDA graph, replayed
back to back (decode_floor.graph_ms); µs per call, the K/V bytes the rows' sequences hold (once each) over that time,
and the largest difference from the row-by-row output.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_info  # noqa: E402
from benchmarks.decode_floor import graph_ms  # noqa: E402

BLOCK = 16
CASES = {"b=1 decode": (1, 1), "b=1 k=4": (1, 5), "b=32 decode": (32, 1), "b=32 k=4": (32, 5),
         "b=8 k=4": (8, 5), "b=64 decode": (64, 1)}


def batch(seqs: int, rows: int, heads: tuple[int, int, int], context: int, layers: int):
    num_heads, kv_heads, dim = heads
    per_seq = -(-context // BLOCK)
    caches = [(torch.randn(seqs * per_seq + 1, BLOCK, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(seqs * per_seq + 1, BLOCK, kv_heads, dim, device="cuda", dtype=torch.bfloat16))
              for _ in range(layers)]
    tables = torch.arange(seqs * per_seq, dtype=torch.int32, device="cuda").view(seqs, per_seq)
    tables = tables.repeat_interleave(rows, 0)
    ctx = torch.tensor([context - rows + 1 + r for _ in range(seqs) for r in range(rows)], dtype=torch.int32,
                       device="cuda")
    back = torch.arange(rows, dtype=torch.int32, device="cuda").repeat(seqs)
    q = torch.randn(seqs * rows, num_heads, dim, device="cuda", dtype=torch.bfloat16)
    return caches, tables, ctx, back, q


def main(argv=None) -> int:
    from nanoserve.kernels import attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs=3, type=int, default=[32, 8, 128], metavar=("HEADS", "KV_HEADS", "DIM"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=["32:4", "16:4", "32:8"], help="TILE:WARPS")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    heads = tuple(args.heads)
    out = {"env": env_info(), "heads": heads, "context": args.context, "cases": {}}
    defaults = attention.DECODE_GROUP_TILE, attention.DECODE_NUM_WARPS
    for name, (seqs, rows) in CASES.items():
        caches, tables, ctx, back, q = batch(seqs, rows, heads, args.context, args.layers)
        kv_bytes = seqs * args.context * heads[1] * heads[2] * 2 * 2
        ref = None
        rec = out["cases"][name] = {}
        for seq_rows in (1, 5):
            # (row by row the tile plays no part: one run per warp count)
            plain = list({v.split(":")[1]: v for v in args.variants}.values())
            for variant in args.variants if seq_rows > 1 else plain:
                tile, warps = (int(v) for v in variant.split(":"))
                attention.DECODE_GROUP_TILE, attention.DECODE_NUM_WARPS = tile, warps
                run = lambda: [attention.decode_attention(q, k, v, tables, ctx, 0.1, seq_rows=seq_rows,  # noqa: E731
                                                          group_back=back) for k, v in caches]
                got = run()[0].float()
                ref = got if ref is None else ref
                us = graph_ms(run, calls=1) * 1e3 / args.layers
                rec[f"seq_rows={seq_rows} tile={tile} warps={warps}"] = {
                    "us": us, "tb_per_s": kv_bytes / (us * 1e-6) / 1e12, "max_diff": (got - ref).abs().max().item()}
        attention.DECODE_GROUP_TILE, attention.DECODE_NUM_WARPS = defaults
        print(f"{name}: " + ", ".join(f"{k} {v['us']:.1f} us ({v['tb_per_s']:.2f} TB/s)" for k, v in rec.items()),
              flush=True)
        del caches
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
