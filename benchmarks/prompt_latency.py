"""One prompt's time to first token through the public API, with and without the token-count graphs.

`nanoserve bench latency`'s run (LLM.generate([prompt], max_tokens=1) wall time), median of 5 fresh random-id
prompts per length (no prefix-cache hit) after one warm-up each; random bf16 weights, real shapes. Variants: token-count
graphs (the default engine), without them, and with an fp8 KV cache (its stores and the paged prefill over it). Also records
the start-up plan: token counts captured, capture seconds and the graph pool (decode + token-count graphs).
Each (model, variant) runs in a process of its own: an engine built after another in one process measured its
eager prompts 2x slower than a fresh one (round 4's first run).

    python benchmarks/prompt_latency.py [--models qwen3-0.6b llama-3.1-8b] [--lengths 128 1024 4000] [--out FILE]
                                        [--profile]   # + GPU time by kernel kind per length
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, env_info, write_json, write_model_dir  # noqa: E402

VARIANTS = {"graphs": {}, "no-prefill-graphs": {"prefill_graph_sizes": "off"}, "fp8-kv": {"kv_cache_dtype": "fp8"}}
REPEATS = 5


def measure(model_dir: str, lengths: list[int], options: dict, profile: bool = False) -> dict:
    """The start-up plan, then per length `nanoserve bench latency --batch-size 1 --output-len 1` (greedy):
    REPEATS fresh prompts after one warm-up."""
    from nanoserve import LLM
    from nanoserve.bench.offline import run_latency

    start = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              show_progress=False, **options)
    runner = llm.engine.core.runner
    info, graphs = runner.info, runner.graphs
    rec = {"start_up_s": time.perf_counter() - start, "decode_sizes": list(info.decode_graph_sizes),
           "token_sizes": list(info.token_graph_sizes), "capture_s": graphs.capture_seconds,
           "pool_mib": graphs.pool_bytes / 2**20, "ttft_ms": {}}
    for seed, n in enumerate(lengths):
        graphed = runner.counters.prefill_steps_graph
        result = run_latency(llm, 1, n, 1, num_iters=REPEATS, num_iters_warmup=1, seed=seed, temperature=0.0,
                             log=lambda line: None)
        samples = [s * 1e3 for s in result["latencies"]]
        rec["ttft_ms"][str(n)] = {"median": statistics.median(samples), "min": min(samples), "samples": samples,
                                  "graphed_steps": runner.counters.prefill_steps_graph - graphed}
        if profile:
            rec.setdefault("profile", {})[str(n)] = _profile(llm, n, seed)
    llm.close()
    return rec


def _profile(llm, n: int, seed: int) -> dict:
    """GPU time by kernel kind over one more fresh prompt of n tokens (decode_floor.py's table; a graph replay's
    kernels are seen one by one)."""
    from nanoserve.bench.profile import kind_table, profile_step
    from nanoserve import SamplingParams

    prompt = torch.randint(0, 10000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return kind_table(profile_step(lambda: llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0),
                                                        use_tqdm=False)))


def _in_own_process(name: str, variant: str, lengths: list[int], profile: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", name, variant, "--lengths", *map(str, lengths)]
    cmd += ["--profile"] if profile else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 1024, 4000])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "prompt_latency.json")
    p.add_argument("--profile", action="store_true", help="also GPU time by kernel kind, per length (torch.profiler)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(write_model_dir(args.one[0], tmp))
            print("RESULT " + json.dumps(measure(model_dir, args.lengths, VARIANTS[args.one[1]], args.profile)))
        return 0
    if not torch.cuda.is_available():
        print("prompt_latency.py needs a CUDA GPU")
        return 0
    report = {"env": env_info(), "command": " ".join(sys.argv), "repeats": REPEATS, "models": {}}
    for name in args.models:
        for variant in args.variants:
            rec = _in_own_process(name, variant, args.lengths, args.profile)
            report["models"].setdefault(name, {})[variant] = rec
            ttft = ", ".join(f"{n}: {r['median']:.2f} ms" for n, r in rec["ttft_ms"].items())
            print(f"{name:14s} {variant:18s} TTFT {ttft}; token sizes {rec['token_sizes']}; capture "
                  f"{rec['capture_s']:.2f} s; pool {rec['pool_mib']:.0f} MiB; start-up {rec['start_up_s']:.1f} s",
                  flush=True)
    print(f"wrote {write_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
