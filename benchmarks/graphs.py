"""CUDA-graph buckets on real model shapes: powers of two vs the measured plan (issue 13).

For each model (random bf16 weights from a real config.json, load_format="dummy", max_num_seqs 256)
this runs the `nanoserve bench graphs` report (nanoserve/bench_graphs.py): per size the replay ms,
eager ms, capture seconds and graph memory; the plan from the curve fitted to the powers of two;
and for batch sizes uniform over 1..256 the expected padded-time waste of both sets. It prints the
issue's target lines (waste ≤ 3%, capture of the planned set ≤ 5 s, pool ≤ 512 MiB) and writes
<out>/<name>.json and <out>/<name>.png.

    python benchmarks/graphs.py                           # both models → benchmarks/results/graphs_h200.*
    python benchmarks/graphs.py --models qwen3-0.6b --out /tmp/graphs
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import (  # noqa: E402
    MODEL_CONFIGS,
    RESULTS_DIR,
    env_info,
    release_cuda_memory,
    write_json,
    write_model_dir,
)
from nanoserve.bench_graphs import format_report, plot_reports, run_graphs_report  # noqa: E402

DEFAULT_MODELS = ["qwen3-0.6b", "llama-3.1-8b"]
TARGETS = {"waste_pct": 3.0, "capture_s": 5.0, "pool_mib": 512.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="CUDA-graph sizes: powers of two vs the plan, on real model shapes")
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(MODEL_CONFIGS))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache per row")
    p.add_argument("--distribution", default="uniform", help="'uniform' or a batch-histogram file")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    p.add_argument("--name", default="graphs_h200", help="file name stem of the JSON and PNG")
    return p.parse_args(argv)


def target_lines(report: dict) -> list[str]:
    """The issue's targets for one model's report, each with its measured value and verdict."""
    plan, pow2 = report["sets"]["plan"], report["sets"]["powers_of_two"]
    n = report["settings"]["max_num_seqs"]
    checks = [
        (f"expected padded-time waste, b uniform in 1..{n}: plan {plan['waste_pct']:.2f}% "
         f"({plan['num_sizes']} sizes; powers of two {pow2['waste_pct']:.2f}%, {pow2['num_sizes']} sizes)",
         plan["waste_pct"], TARGETS["waste_pct"], "%"),
        (f"capture of the planned set {plan['capture_s']:.2f} s (predicted {plan['predicted_capture_s']:.2f} s)",
         plan["capture_s"], TARGETS["capture_s"], " s"),
        (f"graph pool of the planned set {plan['pool_mib']:.0f} MiB (predicted {plan['predicted_pool_mib']:.0f} MiB)",
         plan["pool_mib"], TARGETS["pool_mib"], " MiB"),
    ]
    return [f"{'PASS' if value <= limit else 'FAIL'}  {text}  [target ≤ {limit:g}{unit}]"
            for text, value, limit, unit in checks]


def measure_model(name: str, args: argparse.Namespace) -> dict:
    options = {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
               "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False}
    with tempfile.TemporaryDirectory(prefix=f"nanoserve-{name}-") as tmp:
        model_dir = write_model_dir(name, tmp)
        report = run_graphs_report(str(model_dir), options, distribution=args.distribution, context=args.context,
                                   warmup=args.warmup, iters=args.iters,
                                   log=lambda line: print(f"[{name}] {line}", flush=True))
    report["model"] = name
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("graphs: CUDA is not available; this benchmark captures and times CUDA graphs and needs a GPU.")
        return 1
    start = time.perf_counter()
    result: dict = {"benchmark": "graphs", "env": env_info(), "targets": TARGETS, "models": []}
    out_json, reports, lines = args.out / f"{args.name}.json", [], []
    for name in args.models:
        try:
            report = measure_model(name, args)
            reports.append(report)
            result["models"].append(report)
            print(format_report(report), flush=True)
            lines += [f"{name}: {line}" for line in target_lines(report)]
        except Exception as error:  # one model's failure must not lose the other's numbers
            traceback.print_exc()
            result["models"].append({"model": name, "error": f"{type(error).__name__}: {error}"})
        finally:
            release_cuda_memory()
        result["total_seconds"] = time.perf_counter() - start
        write_json(out_json, result)
    result["target_lines"] = lines
    write_json(out_json, result)
    print(f"wrote {out_json}")
    if reports:
        print(f"wrote {plot_reports(reports, args.out / f'{args.name}.png')}")
    print("\n".join(["", "targets (issue 13):", *lines]))
    print(f"total {result['total_seconds']:.0f} s")
    return 0 if reports and len(reports) == len(args.models) else 1


if __name__ == "__main__":
    sys.exit(main())
