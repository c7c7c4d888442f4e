"""Where the host time of an eager prompt step goes: one long prompt (over the largest token-count graph) through
`LLM.generate(max_tokens=1)`, its wall time (median of REPEATS fresh prompts), its kernels' GPU busy time
(torch.profiler), and a cProfile of one more run (the functions with the most time of their own).

Each variant runs in a process of its own (env: kernel switches such as NANOSERVE_PDL=0).

    python benchmarks/prompt_host.py [--model qwen3-0.6b] [--tokens 4000] [--variants default eager eager_no_pdl]
                                     [--rounds N] [--json FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_info, write_json, write_model_dir  # noqa: E402

REPEATS = 9
# (environment, engine options) per variant: "default" runs the prompt as graphed chunks of at most the largest
# token-count graph (the default token budget on CUDA since round 7), "eager" in one eager step (8192 tokens a step)
VARIANTS = {"default": ({}, {}), "eager": ({}, {"max_num_batched_tokens": 8192}),
            "eager_no_pdl": ({"NANOSERVE_PDL": "0"}, {"max_num_batched_tokens": 8192})}


def measure(model: str, tokens: int, options: dict) -> dict:
    import torch

    from nanoserve.bench.profile import kind_table, profile_step
    from nanoserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(write_model_dir(model, tmp)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=max(4096, tokens + 16), show_progress=False, **options)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    launches = []

    def run() -> float:
        """Wall ms of one prompt; the host ms until its first step() returned (the step launched) kept aside."""
        prompt = torch.randint(0, 10000, (tokens,), generator=gen).tolist()
        start = time.perf_counter()
        llm.engine.add_request("p", prompt, params, stream=False)
        llm.engine.step()
        launches.append((time.perf_counter() - start) * 1e3)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        return (time.perf_counter() - start) * 1e3

    run()
    launches.clear()
    samples = [run() for _ in range(REPEATS)]
    prompt = torch.randint(0, 10000, (tokens,), generator=gen).tolist()
    kinds = kind_table(profile_step(lambda: llm.generate([prompt], params, use_tqdm=False)))
    prof = cProfile.Profile()
    prompt = torch.randint(0, 10000, (tokens,), generator=gen).tolist()
    prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    cum = io.StringIO()
    pstats.Stats(prof, stream=cum).sort_stats("cumulative").print_stats(40)
    llm.close()
    return {"wall_ms": {"median": statistics.median(samples), "samples": samples},
            "first_step_host_ms": {"median": statistics.median(launches), "samples": launches},
            "kernels": {k: kinds[k] for k in ("kernels", "span_us", "busy_us")}, "kinds": kinds.get("kinds"),
            "cprofile_tottime": text.getvalue()[-6000:], "cprofile_cumulative": cum.getvalue()[-8000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args.model, args.tokens, VARIANTS[args.one][1])))
        return 0
    report = {"env": env_info(), "command": " ".join(sys.argv), "model": args.model, "tokens": args.tokens,
              "variants": {}}
    for round_ in range(args.rounds):
        for name in args.variants:
            env = {**os.environ, **VARIANTS[name][0]}
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--model", args.model, "--tokens",
                                   str(args.tokens)], capture_output=True, text=True, env=env)
            if proc.returncode:
                print(proc.stderr[-3000:])
                continue
            rec = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
            report["variants"][f"{name}_{round_}"] = rec
            print(f"{name} round {round_}: wall {rec['wall_ms']['median']:.2f} ms (first step's host "
                  f"{rec['first_step_host_ms']['median']:.2f} ms), kernels {rec['kernels']}", flush=True)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
