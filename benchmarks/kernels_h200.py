"""The kernels package on the H200, in one run (~8 minutes, at most 11): GPU tests, GEMV sweep, decode profile.

    OUT=/path python benchmarks/kernels_h200.py        # or: python benchmarks/kernels_h200.py --out /path

1. `pytest -m gpu tests/kernels tests/model tests/runner` (every kernel against its reference on the GPU,
   with PDL; the fused model == the unfused one; graph replay == eager for every bucket);
2. benchmarks/gemv.py: the few-row GEMV sweep, M = 1..64 over the decode matrices of the three shapes
   (<= 3 minutes), which prints the GEMV_TABLE to paste into nanoserve/kernels/gemv.py;
3. benchmarks/profile_decode.py at b = 1 and 32 for each shape: replay ms, kernels per step and time per
   kernel kind under each switch set (PDL, each fusion), graph edges, replay == eager;
4. a short table: replay ms against the issue's targets, what PDL and each fusion are worth.
Every stage runs in its own process under a time limit; a failing stage is reported and the run goes on.
`--skip tests gemv` (or `--skip profile`) splits the run in two when one command may take at most 10 minutes.
Writes to OUT: run.log, gemv_sweep.json, profile_<model>.json (3), summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import read_json, stage  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (model, switch sets): Llama-3.1-8B is bandwidth-bound and slow to set up, so it measures fewer sets.
ALL_SETS = ["all", "no_pdl", "no_fuse_norm", "no_fuse_silu", "no_fuse_merge", "none"]
PROFILES = [("qwen3-0.6b", ALL_SETS, 100), ("smollm2-135m", ALL_SETS, 90),
            ("llama-3.1-8b", ["all", "no_pdl", "none"], 110)]  # (model, switch sets, time limit s)
TARGETS_MS = {("qwen3-0.6b", 1): 0.60, ("qwen3-0.6b", 32): 1.00, ("llama-3.1-8b", 1): 3.85,
              ("llama-3.1-8b", 32): 4.60, ("smollm2-135m", 1): 0.40}  # issue 9
BEFORE_MS = {("qwen3-0.6b", 1): 1.00, ("qwen3-0.6b", 32): 1.71, ("llama-3.1-8b", 1): 4.26,
             ("llama-3.1-8b", 32): 5.35, ("smollm2-135m", 1): 0.92}


def summarize(out: Path, stages: list[dict]) -> dict:
    summary: dict = {"stages": stages, "replay": [], "gemv": None}
    for model, _, _ in PROFILES:
        report = read_json(out / f"profile_{model}.json") or {}
        for row in report.get("summary", []):
            key = (row["model"], row["b"])
            row["target_ms"], row["before_ms"] = TARGETS_MS.get(key), BEFORE_MS.get(key)
            summary["replay"].append(row)
    sweep = read_json(out / "gemv_sweep.json")
    if sweep:
        summary["gemv"] = {"summary": sweep.get("summary"), "table_source": sweep.get("table_source"),
                           "precompile": sweep.get("precompile"), "elapsed_s": sweep.get("elapsed_s")}
    return summary


def print_table(summary: dict) -> None:
    print("\n================ summary ================")
    for s in summary["stages"]:
        print(f"  {s['stage']:<24} exit {s['exit']}  {s['seconds']} s")
    print(f"\n{'model':<14}{'b':>4}{'before':>8}{'target':>8}{'now':>8}  {'met':<5}{'no_pdl':>8}{'none':>8}"
          f"{'kernels all/none':>18}  PDL edges  ==eager  other sets")
    for r in summary["replay"]:
        ms = r["replay_ms"]
        now = ms.get("all")
        met = "-" if r["target_ms"] is None or now is None else ("yes" if now <= r["target_ms"] else "no")
        fmt = lambda v: f"{v:8.3f}" if isinstance(v, (int, float)) else f"{'-':>8}"  # noqa: E731
        others = ", ".join(f"{k} {v:.3f}" for k, v in ms.items() if k not in ("all", "no_pdl", "none"))
        kernels = f"{r['kernels'].get('all', '-')}/{r['kernels'].get('none', '-')}"
        print(f"{r['model']:<14}{r['b']:>4}{fmt(r['before_ms'])}{fmt(r['target_ms'])}{fmt(now)}  {met:<5}"
              f"{fmt(ms.get('no_pdl'))}{fmt(ms.get('none'))}{kernels:>18}  {str(r['pdl_edges_ok']):<9}  "
              f"{str(r['replay_equals_eager']):<7}  {others}")
    gemv = summary.get("gemv")
    if gemv and gemv.get("summary"):
        s = gemv["summary"]
        print(f"\nGEMV sweep: correct {s.get('correct')}; geomean speedup vs cuBLAS: table "
              f"x{s.get('table_geomean_speedup_vs_cublas') or float('nan'):.2f}, best "
              f"x{s.get('best_geomean_speedup_vs_cublas') or float('nan'):.2f}; PDL on the table variant "
              f"x{s.get('pdl_geomean_speedup_of_table_variant') or float('nan'):.2f}")
        print(f"table to paste into nanoserve/kernels/gemv.py:\n{gemv.get('table_source')}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/nanoserve-kernels")))
    p.add_argument("--skip", nargs="*", default=[], choices=["tests", "gemv", "profile"])
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    stages = []
    with open(out / "run.log", "a") as log:
        if "tests" not in args.skip:
            stages.append(stage("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                              "tests/kernels", "tests/model", "tests/runner"], 200, log))
        if "gemv" not in args.skip:
            stages.append(stage("gemv sweep", [py, "benchmarks/gemv.py", str(out / "gemv_sweep.json"),
                                               "--budget-s", "130"], 170, log))
        if "profile" not in args.skip:
            for model, sets, limit in PROFILES:
                stages.append(stage(f"profile {model}", [py, "benchmarks/profile_decode.py", "--models", model,
                                                         "--batch-sizes", "1", "32", "--switch-sets", *sets,
                                                         "--json", str(out / f"profile_{model}.json")], limit, log))
    summary = summarize(out, stages)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    return 0 if all(s["exit"] == 0 for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
