"""What the CUDA-graph pool really holds: the pool growth the runner records per graph (memory_reserved deltas,
what the planner's budget counts) against the allocator's own segments of the graphs' pool (torch's memory
snapshot: reserved and allocated bytes per memory pool), after an "auto" start-up.

    python benchmarks/graph_pool.py [--models qwen3-0.6b llama-3.1-8b] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, env_info, model_config, write_json, write_model_dir  # noqa: E402

MIB = 2**20


def pools() -> dict:
    """Reserved / allocated MiB and segment count per allocator pool ("default" is the ordinary caching pool)."""
    out: dict = defaultdict(lambda: {"reserved_mib": 0.0, "allocated_mib": 0.0, "segments": 0, "largest_mib": 0.0})
    for seg in torch.cuda.memory_snapshot():
        pool = seg.get("segment_pool_id", (0, 0))
        key = "default" if tuple(pool) == (0, 0) else str(tuple(pool))
        row = out[key]
        row["reserved_mib"] += seg["total_size"] / MIB
        row["allocated_mib"] += seg["allocated_size"] / MIB
        row["segments"] += 1
        row["largest_mib"] = max(row["largest_mib"], seg["total_size"] / MIB)
    return dict(out)


def measure(model_dir: str) -> dict:
    from nanoserve import LLM

    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              show_progress=False)
    runner = llm.engine.core.runner
    rec = {}
    for name, gr in (("decode", runner.graph_runner), ("tokens", runner.token_graphs)):
        if gr is not None:
            rec[name] = {"sizes": gr.capture_sizes, "pool_growth_mib": {str(k): v / MIB for k, v in
                                                                        sorted(gr.pool_growth.items())},
                         "recorded_mib": gr.pool_bytes / MIB}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    rec["allocator_pools"] = pools()
    rec["memory_reserved_mib"] = torch.cuda.memory_reserved() / MIB
    rec["memory_allocated_mib"] = torch.cuda.memory_allocated() / MIB
    llm.close()
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "graph_pool.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(measure(str(write_model_dir(model_config(args.one), tmp)))))
        return 0
    if not torch.cuda.is_available():
        print("graph_pool.py needs a CUDA GPU")
        return 0
    report = {"env": env_info(), "command": " ".join(sys.argv), "models": {}}
    for name in args.models:
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:])
            continue
        rec = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
        report["models"][name] = rec
        print(name, json.dumps({k: v for k, v in rec.items() if k != "allocator_pools"})[:600])
        print("   pools", json.dumps(rec["allocator_pools"]))
    print(f"wrote {write_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
