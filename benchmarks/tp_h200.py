"""Tensor parallelism on 2 H200s, in one run (~6 minutes, at most 9): GPU tests, then the latency benchmark.

    OUT=/path python benchmarks/tp_h200.py        # or: python benchmarks/tp_h200.py --out /path

1. `pytest -m gpu tests/runner/test_tensor_parallel_gpu.py` (an all-reduce captured in a CUDA graph sums at
   every replay; fp32 tiny-model greedy tokens at tp=2 with graphs == tp=1; rank 0's graphs hold the NCCL
   kernels; a killed worker is a WorkerError, not a hang) and the CPU tensor-parallel tests (gloo);
2. `pytest -m gpu tests/model tests/runner` at tp=1: the sharded layers must leave the one-GPU paths as they were;
3. benchmarks/tp_latency.py: Llama-3.1-8B shape, graph replay b=1 and b=64 at tp=1 and tp=2, the ratios
   against the targets (b=1 ≤ 0.62, b=64 ≤ 0.65).
Every stage runs in its own process under a time limit; a failing stage is reported and the run goes on.
Writes to OUT: run.log, tp_latency.json, summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import read_json, stage  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/nanoserve-tp")))
    p.add_argument("--skip", nargs="*", default=[], choices=["tests", "regression", "latency"])
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    py, pytest = sys.executable, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    stages = []
    with open(out / "run.log", "a") as log:
        if "tests" not in args.skip:
            stages.append(stage("tp tests", [*pytest, "tests/runner/test_tensor_parallel_gpu.py",
                                             "tests/runner/test_tensor_parallel.py", "tests/model/test_parallel.py"],
                                240, log))
        if "regression" not in args.skip:
            stages.append(stage("tp=1 gpu tests", [*pytest, "-m", "gpu", "tests/model", "tests/runner",
                                                   "--ignore=tests/runner/test_tensor_parallel_gpu.py"], 200, log))
        if "latency" not in args.skip:
            stages.append(stage("tp latency", [py, "benchmarks/tp_latency.py", "--out", str(out)], 240, log))
    latency = read_json(out / "tp_latency.json") or {}
    summary = {"stages": stages, "ratios": latency.get("ratios"),
               "replay_ms": {f"tp{r['tensor_parallel_size']}_b{pt['batch_size']}": pt.get("replay_ms")
                             for r in latency.get("runs", []) for pt in r.get("points", [])}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n================ summary ================")
    for s in stages:
        print(f"  {s['stage']:<16} exit {s['exit']}  {s['seconds']} s")
    for key, ms in summary["replay_ms"].items():
        print(f"  replay {key}: {ms if ms is None else round(ms, 3)} ms")
    for key, r in (summary["ratios"] or {}).items():
        print(f"  {key}: ratio {r['ratio'] if r['ratio'] is None else round(r['ratio'], 3)} "
              f"(target ≤ {r['target']}, met: {r['met']})")
    return 0 if all(s["exit"] == 0 for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
