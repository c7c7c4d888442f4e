"""The start-up bucket plan ("auto") against powers of two, from one engine per model shape.

Each engine plans its CUDA-graph sizes at start-up (runner/graph_setup.py: probe replays → StepCurve →
plan_buckets under the capture-time and pool budgets). Afterwards every captured size is replayed here
(context 512, CUDA-event median), the step-time curve is refitted on all those points, and the expected
padded step time over b uniform in 1..max_num_seqs is computed for the plan and for powers of two:
waste = E[t(bucket(b))] / E[t(b)] - 1. Capture seconds are the runner's (warm-up + capture of the planned
sizes with compiled kernels, i.e. a start-up with a warm Triton cache) beside the wall time of this
(cold) start-up; pool MiB is the graph pool's growth.

    python benchmarks/graph_plan.py [--models qwen3-0.6b llama-3.1-8b] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR, env_info, model_config, release_cuda_memory, time_ms, write_json, write_model_dir)
from nanoserve.config import default_capture_sizes  # noqa: E402
from nanoserve.runner.bucket_plan import BatchDistribution, StepCurve, expected_waste  # noqa: E402

CONTEXT = 512
TARGET_WASTE, TARGET_CAPTURE_S, TARGET_POOL_MIB = 0.03, 5.0, 512  # issue 13


def measure(name: str, max_num_seqs: int) -> dict:
    from nanoserve import LLM

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        llm = LLM(str(write_model_dir(model_config(name), tmp)), load_format="dummy", skip_tokenizer_init=True,
                  max_num_seqs=max_num_seqs, max_model_len=2048, show_progress=False)
        startup = time.perf_counter() - started
        runner = llm.engine.core.runner
        gr = runner.graph_runner
        with torch.inference_mode():
            replay = {b: sorted(time_ms(partial(runner.decode_logits, runner.dummy_decode_batch(b, CONTEXT)), "cuda",
                                        warmup=3, iters=15))[7] for b in gr.capture_sizes}
        curve = StepCurve.fit({**dict(zip(runner.step_curve.rows, runner.step_curve.ms)), **replay})
        uniform = BatchDistribution.uniform(max_num_seqs)
        rec = {"model": name, "max_num_seqs": max_num_seqs, "planned_sizes": gr.capture_sizes,
               "replay_ms": replay, "probe_curve_ms": dict(zip(runner.step_curve.rows, runner.step_curve.ms)),
               "waste_plan": expected_waste(gr.capture_sizes, curve, uniform),
               "waste_pow2": expected_waste(default_capture_sizes(max_num_seqs), curve, uniform),
               "capture_seconds": gr.capture_seconds, "capture_wall_seconds_cold": gr.wall_seconds,
               "pool_mib": gr.pool_bytes / 2**20, "engine_startup_seconds": startup}
        rec["targets_met"] = {"waste": rec["waste_plan"] <= TARGET_WASTE,
                              "capture_s": rec["capture_seconds"] <= TARGET_CAPTURE_S,
                              "pool_mib": rec["pool_mib"] <= TARGET_POOL_MIB}
        del llm, runner, gr
    release_cuda_memory()
    print(f"{name}: {len(rec['planned_sizes'])} sizes {rec['planned_sizes']}\n  waste plan {100 * rec['waste_plan']:.2f}% "
          f"vs powers of two {100 * rec['waste_pow2']:.2f}% (target ≤ 3%); capture {rec['capture_seconds']:.2f} s "
          f"(cold start {rec['capture_wall_seconds_cold']:.1f} s); pool {rec['pool_mib']:.0f} MiB", flush=True)
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("graph_plan.py needs a CUDA GPU")
        return 0
    report = {"env": env_info(), "context": CONTEXT, "models": [measure(m, args.max_num_seqs) for m in args.models]}
    print(f"wrote {write_json(args.out / 'graph_plan.json', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
