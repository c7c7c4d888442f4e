"""Does a plain decode step cost differently in an engine that speculates than in one that doesn't (issue 38)?

    python benchmarks/speculative_drift.py [--model llama-3.1-8b] [--steps 200] [--out DIR]

speculative_verify.py --plain read Llama-3.1-8B's b = 1 plain step 3-6% apart between its two engines, both ways
round between runs, and the k = 4 target's ratio moved with it. Here four engines of one process (plain, spec,
plain, spec; random weights, 512-token contexts) each time their b = 1 plain step in time_step's default windows
(5 + 30 steps, the benchmark's) right after start-up and again after a 2 s sleep, then in 3 windows of 20 + 200 steps
at b = 1 and 32; the speculating ones (ngram, k = 4) their k = 4 verification too. Run beside `nvidia-smi dmon` to
see the clocks (speculative_gpu.sh drift).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (RESULTS_DIR, env_info, model_config, release_cuda_memory,  # noqa: E402
                               start_engine, write_json, write_model_dir)

CONTEXT, K = 512, 4


def windows(runner, batch, count: int, **loop) -> list[float]:
    from nanoserve.bench.decode_step import time_step
    return [statistics.median(time_step(runner, batch, **loop)) for _ in range(count)]


def one_engine(model: str, kind: str, steps: int) -> dict:
    from nanoserve.bench.decode_step import sampled_decode_batch, verify_batch

    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": K}} if kind == "spec" else {}
    llm, startup = start_engine(model, 256, 4096, **spec)
    runner = llm.engine.core.runner
    rec = {"kind": kind, "kv_blocks": startup["kv_blocks"]}
    batch = sampled_decode_batch(runner, 1, CONTEXT)
    rec["short_first_b1"] = windows(runner, batch, 4)
    time.sleep(2)
    rec["short_after_2s_b1"] = windows(runner, batch, 4)
    long = {"warmup": 20, "iters": steps}
    for b in (1, 32):
        rec[f"decode_b{b}"] = windows(runner, sampled_decode_batch(runner, b, CONTEXT), 3, **long)
        if kind == "spec":
            rec[f"verify_b{b}"] = windows(runner, verify_batch(runner, b, CONTEXT, K), 3, **long)
            rec[f"decode_again_b{b}"] = windows(runner, sampled_decode_batch(runner, b, CONTEXT), 1, **long)
    llm.close()
    release_cuda_memory()
    print(rec, flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a shape name (benchmarks/shapes)")
    ap.add_argument("--steps", type=int, default=200, help="steps a long window (after 20 warm-up steps)")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_model_dir(model_config(args.model), Path(tmp) / "target"))
        engines = [one_engine(model, kind, args.steps) for kind in ("plain", "spec", "plain", "spec")]
    write_json(Path(args.out) / "speculative_drift.json", {"env": env_info(), "model": args.model, "context": CONTEXT,
                                                              "engines": engines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
