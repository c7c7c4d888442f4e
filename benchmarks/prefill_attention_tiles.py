"""The paged prefill kernel's tilings, timed on the prompt / mixed steps the token-count graphs replay.

The kernel's time at 1024 fresh tokens is the longest program's chain of K/V tiles (the causal diagonal's last
tile reads every key), not its FLOPs; this sweep times (block_m, block_n, num_warps, num_stages) against the
default (kernels.attention.prefill_tiles) and torch's flash varlen on fresh prompts, and checks every tiling
against the default's output. Qwen3-0.6B (16 q / 8 kv heads) and Llama-3.1-8B (32 / 8), head_dim 128, bf16.

    python benchmarks/prefill_attention_tiles.py [--out FILE] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import env_info, write_json  # noqa: E402
from nanoserve.kernels import attention as tk  # noqa: E402
from nanoserve.model.attention_metadata import AttentionMetadata  # noqa: E402

MODELS = {"qwen3-0.6b": (16, 8, 28), "llama-3.1-8b": (32, 8, 32)}  # q heads, kv heads, layers
HEAD_DIM, BLOCK_SIZE, DTYPE = 128, 16, torch.bfloat16
CASES = {  # (cached tokens, new tokens) per sequence
    "fresh 1024": [(0, 1024)],
    "fresh 2048": [(0, 2048)],
    "fresh 4 x 256": [(0, 256)] * 4,
    "chunk 1024 after 3072": [(3072, 1024)],
    "fresh 960 + 64 decode rows (ctx 1024)": [(0, 960)] + [(1023, 1)] * 64,
}
GRID = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
QUICK = {"block_m": (64, 128), "block_n": (64, 128), "num_warps": (4, 8), "num_stages": (3,)}


class Case:
    """Random q and a shuffled paged K/V cache holding every sequence's context (cached + new tokens)."""

    def __init__(self, specs, num_heads: int, num_kv_heads: int, gen: torch.Generator):
        dev = torch.device("cuda")
        blocks = [-(-(c + n) // BLOCK_SIZE) for c, n in specs]
        total = sum(blocks) + 1
        self.k_cache = torch.randn(total, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(dev, DTYPE)
        self.v_cache = torch.randn(total, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(dev, DTYPE)
        perm = torch.randperm(total - 1, generator=gen)
        width = max(blocks)
        self.tables = torch.full((len(specs), width), total - 1, dtype=torch.int32)
        at = 0
        for i, b in enumerate(blocks):
            self.tables[i, :b] = perm[at:at + b]
            at += b
        self.tables = self.tables.to(dev)
        self.new = [n for _, n in specs]
        self.ctx = [c + n for c, n in specs]
        self.q = torch.randn(sum(self.new), num_heads, HEAD_DIM, generator=gen).to(dev, DTYPE)
        self.fresh = all(c == 0 for c, _ in specs)

    def meta(self, q_per_tile: int) -> AttentionMetadata:
        dev = self.q.device
        seq, start = tk.prefill_work(self.new, q_per_tile, self.ctx)
        cu = torch.tensor([0] + self.new, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
        return AttentionMetadata(
            is_prefill=True, slot_mapping=torch.zeros(1, dtype=torch.int64, device=dev),
            context_lens=torch.tensor(self.ctx, dtype=torch.int32, device=dev), block_tables=self.tables,
            cu_seqlens_q=cu, max_seqlen_q=max(self.new), has_cached_prefix=not self.fresh,
            work_seq=torch.from_numpy(seq).to(dev), work_start=torch.from_numpy(start).to(dev))


def tilings(group: int, grid: dict) -> list[tk.PrefillTiles]:
    default = tk.prefill_tiles(group, HEAD_DIM, 2)
    out = [default]
    for m, n, w, s in itertools.product(*grid.values()):
        t = tk.PrefillTiles(group, default.block_d, m, n, w, s)
        if t != default:
            out.append(t)
    return out


def time_us(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def sweep_model(name: str, grid: dict) -> dict:
    heads, kv_heads, layers = MODELS[name]
    gen = torch.Generator().manual_seed(0)
    cases = {label: Case(specs, heads, kv_heads, gen) for label, specs in CASES.items()}
    rows, scale = [], HEAD_DIM ** -0.5
    refs = {}
    for tiles in tilings(heads // kv_heads, grid):
        row = {"tiles": {k: getattr(tiles, k) for k in ("block_m", "block_n", "num_warps", "num_stages")}, "us": {}}
        try:
            for label, c in cases.items():
                meta = c.meta(tiles.q_per_tile)
                run = lambda: tk.paged_prefill_attention(c.q, c.k_cache, c.v_cache, meta, scale, tiles)  # noqa
                out = run()
                ref = refs.setdefault(label, out)  # the default tiling comes first
                row.setdefault("max_abs_diff", {})[label] = float((out.float() - ref.float()).abs().max())
                row["us"][label] = time_us(run)
        except Exception as e:  # a tiling that does not compile (shared memory, registers): recorded, skipped
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc(limit=1)
        rows.append(row)
        print(name, row["tiles"], {k: round(v, 1) for k, v in row["us"].items()}, row.get("error", ""), flush=True)
    return {"layers": layers, "tilings": rows, "flash_varlen_us": _flash(cases, scale)}


def _flash(cases: dict, scale: float) -> dict:
    """torch's flash varlen on the fresh cases (k/v as contiguous tensors), for comparison."""
    varlen, kwargs = tk._varlen_attn, tk._VARLEN_KWARGS
    if varlen is None:
        return {}
    out = {}
    for label, c in cases.items():
        if not c.fresh:
            continue
        total, kv_heads = c.q.shape[0], c.k_cache.shape[2]
        k = torch.randn(total, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        cu = torch.tensor([0] + c.new, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        m = max(c.new)
        out[label] = time_us(lambda: varlen(c.q, k, v, cu, cu, m, m, scale=scale, **kwargs))  # noqa: B023
    return out


def best(result: dict) -> dict:
    """Per case: the default's time, the fastest tiling and its time."""
    rows = [r for r in result["tilings"] if "error" not in r]
    summary = {}
    for label in CASES:
        fastest = min(rows, key=lambda r: r["us"][label])
        summary[label] = {"default_us": rows[0]["us"][label], "best_us": fastest["us"][label],
                          "best_tiles": fastest["tiles"]}
    totals = {str(r["tiles"]): sum(r["us"].values()) for r in rows}
    summary["best over all cases"] = min(totals, key=totals.get)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="prefill_attention_tiles.json")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    args = p.parse_args()
    data = {"env": env_info(), "command": " ".join(sys.argv), "models": {}}
    for name in MODELS:
        data["models"][name] = result = sweep_model(name, QUICK if args.quick else GRID)
        result["summary"] = best(result)
        write_json(args.out, data)
        print(name, result["summary"], "flash:", result["flash_varlen_us"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
