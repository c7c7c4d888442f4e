"""The cost of verifying drafts (issue 38): a step that verifies k drafts on each of b rows against a plain decode step
of b rows, on real shapes with random bf16 weights, in one run.

    python benchmarks/speculative_verify.py [--models llama-3.1-8b qwen3-0.6b] [--batch-sizes 1 4 8 16 32 64]
                                            [--drafts 1 2 4 8] [--workload FILE] [--out DIR]

One engine per model (max_num_seqs 256, speculative_config ngram with the largest k, so the sampler holds every row;
planned decode and token-count graphs as the engine plans them). Both steps are the engine's own (ModelRunner.execute,
sampled greedily, tokens read back: bench/decode_step.py, the batch built by engine/batching.py): the decode step
replays its batch-size graph; the verification step (each row's last token and its k drafts, every row sampled and
checked) runs its b·(k+1) tokens as decode rows through the smallest batch-size graph of at least that many rows
(up to 256), else through the smallest token-count graph of at least b·(k+1) tokens. 512-token contexts.
Targets (H200, Llama-3.1-8B): k = 4 at b = 1 <= 1.10x the decode step, at b = 32 <= 1.35x.
--workload: a benchmarks/speculative.py result (the real SmolLM2 on the copy-heavy workload); its measured mean
accepted length per verification gives the projected Llama-3.1-8B b = 1 tok/s: tokens per step / verify ms, against
a decode step's 1 token / decode ms (target >= 1.8x today's 248 tok/s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (RESULTS_DIR, check, env_info, model_config, release_cuda_memory,  # noqa: E402
                               start_engine, write_json, write_model_dir)

CONTEXT = 512
MAX_NUM_SEQS = 256  # the default: verifications of up to 256 tokens run as decode rows, larger ones as token steps
TARGETS = {("llama-3.1-8b", 1, 4): 1.10, ("llama-3.1-8b", 32, 4): 1.35}
PROJECTED_MIN, TODAY_TOK_S = 1.8, 248.0  # Llama-3.1-8B b = 1 tok/s today (issue 38)


def measure(name: str, batch_sizes: list[int], drafts: list[int]) -> dict:
    from nanoserve.bench.decode_step import sampled_decode_batch, time_step, verify_batch
    from nanoserve.bench.profile import kind_table, profile_step

    spec = {"method": "ngram", "num_speculative_tokens": max(drafts)}
    with tempfile.TemporaryDirectory() as tmp:
        llm, startup = start_engine(str(write_model_dir(model_config(name), tmp)), MAX_NUM_SEQS, 4096,
                                    speculative_config=spec)
        runner = llm.engine.core.runner
        rec = {"startup": startup, "steps": {}}
        for b in batch_sizes:
            decode = statistics.median(time_step(runner, sampled_decode_batch(runner, b, CONTEXT)))
            row = {"decode_ms": decode}
            for k in drafts:
                batch = verify_batch(runner, b, CONTEXT, k)
                verify = statistics.median(time_step(runner, batch))
                row[str(k)] = {"verify_ms": verify, "ratio": verify / decode, "as": type(batch).__name__}
                if (name, b, k) in TARGETS:  # where the time goes: one profiled step of each
                    row[str(k)]["profile"] = kind_table(profile_step(lambda: runner.execute(batch).result()))
                    row["profile"] = kind_table(profile_step(
                        lambda: runner.execute(sampled_decode_batch(runner, b, CONTEXT)).result()))
            rec["steps"][str(b)] = row
            print(f"{name} b={b:3d}: decode {decode:.3f} ms; " + ", ".join(
                f"k={k} {row[str(k)]['verify_ms']:.3f} ({row[str(k)]['ratio']:.2f}x)" for k in drafts), flush=True)
        rec["counters"] = dict(vars(runner.counters))
        rec["decode_graph_sizes"] = list(runner.info.decode_graph_sizes)
        llm.close()
    release_cuda_memory()
    return rec


def project(results: dict, workload: dict) -> dict:
    """Llama-3.1-8B b = 1 tok/s on a benchmarks/speculative.py run's copy workload: its steps at b = 1 (the
    verifying ones: num_drafts, yielding accepted + 1 tokens each; every other output token took a plain decode step)
    timed with the verify ms measured here at the method's k (an upper bound when the plan drafted fewer) and the
    decode ms, against today's figure."""
    out = {}
    steps = results.get("llama-3.1-8b", {}).get("steps", {}).get("1")
    if steps is None:
        return out
    configs = workload.get("settings", {}).get("speculative_configs", {})
    for method, run in workload.get("runs", {}).items():
        rec = run.get("workloads", {}).get("copy") or {}
        spec, k = rec.get("speculation"), (configs.get(method) or {}).get("num_speculative_tokens")
        if not spec or not k or str(k) not in steps:
            continue
        plain = rec["output_tokens"] - spec["num_drafts"] - spec["accepted_tokens"]
        ms = spec["num_drafts"] * steps[str(k)]["verify_ms"] + plain * steps["decode_ms"]
        tok_s = 1e3 * rec["output_tokens"] / ms
        out[method] = {"k": k, "mean_accepted_length": spec["mean_accepted_length"], "verifying_steps":
                       spec["num_drafts"], "plain_steps": plain, "tok_s": tok_s, "decode_tok_s": 1e3 / steps["decode_ms"],
                       "today_tok_s": TODAY_TOK_S, "ratio": tok_s / TODAY_TOK_S,
                       "check": check(tok_s / TODAY_TOK_S, PROJECTED_MIN, at_least=True)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--drafts", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--workload", help="a benchmarks/speculative.py JSON, for the projection")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    results = {name: measure(name, args.batch_sizes, args.drafts) for name in args.models}
    targets = {f"{m} b={b} k={k}": check(results[m]["steps"][str(b)][str(k)]["ratio"], limit)
               for (m, b, k), limit in TARGETS.items()
               if m in results and str(b) in results[m]["steps"] and str(k) in results[m]["steps"][str(b)]}
    data = {"env": env_info(), "context": CONTEXT, "results": results, "targets": targets}
    if args.workload:
        data["projection"] = project(results, json.loads(Path(args.workload).read_text()))
    print(json.dumps({"targets": targets, "projection": data.get("projection")}, indent=1))
    write_json(Path(args.out) / "speculative_verify.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
