"""The cost of verifying drafts (issue 38): a step that verifies k drafts on each of b rows against a plain decode step
of b rows, on real shapes with random bf16 weights, in one run.

    python benchmarks/speculative_verify.py [--models llama-3.1-8b qwen3-0.6b] [--batch-sizes 1 4 8 16 32 64]
                                            [--drafts 1 2 4 8] [--draft-models llama-3.1-8b=llama-3.2-1b]
                                            [--workload FILE] [--out DIR]

One engine per model (max_num_seqs 256, speculative_config ngram with the largest k, so the sampler holds every row;
planned decode and token-count graphs as the engine plans them). Both steps are the engine's own (ModelRunner.execute,
sampled greedily, tokens read back: bench/decode_step.py, the batch built by engine/batching.py): the decode step
replays its batch-size graph; the verification step (each row's last token and its k drafts, every row sampled and
checked) runs its b·(k+1) tokens as decode rows through the smallest batch-size graph of at least that many rows
(up to 256), else through the smallest token-count graph of at least b·(k+1) tokens. 512-token contexts.
Targets (H200, Llama-3.1-8B): k = 4 at b = 1 <= 1.10x the decode step, at b = 32 <= 1.35x.
--draft-models TARGET=DRAFT: a second engine per pair, with the draft model (random weights too) proposing the drafts
on the device: its decode step (the draft mirrors every target step: Kind.DECODE) and its verification step (the
draft's k forwards, then the target's: Kind.DRAFT, up to 256 rows), each against the engine without a draft's decode
step ("<target>+<draft>" in the results).
--plain: also an engine without speculative_config per model, whose decode steps show what configuring speculation
costs a plain step (its plain steps replay their own graphs, Kind.DECODE, rows read one by one; verifications
replay Kind.VERIFY's, a sequence's rows one attention group: AttentionMetadata.seq_rows).
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


def measure(name: str, batch_sizes: list[int], drafts: list[int], draft: str | None = None,
            plain: dict | None = None) -> dict:
    """draft: a draft model's shape (its drafts proposed on the device); plain: the same target's results without
    one, whose decode steps the ratios are taken against."""
    from nanoserve.bench.decode_step import reset_device_tokens, sampled_decode_batch, time_step, verify_batch
    from nanoserve.bench.profile import kind_table, profile_step

    spec = {"method": "ngram", "num_speculative_tokens": max(drafts)}
    with tempfile.TemporaryDirectory() as tmp:
        if draft is not None:
            spec = {"method": "draft_model", "num_speculative_tokens": max(drafts),
                    "model": str(write_model_dir(model_config(draft), Path(tmp) / "draft"))}
        llm, startup = start_engine(str(write_model_dir(model_config(name), Path(tmp) / "target")), MAX_NUM_SEQS,
                                    4096, speculative_config=spec)
        runner = llm.engine.core.runner
        rec = {"startup": startup, "steps": {}}
        for b in batch_sizes:
            decode = statistics.median(time_step(runner, sampled_decode_batch(runner, b, CONTEXT)))
            row = {"decode_ms": decode}
            base = plain["steps"][str(b)]["decode_ms"] if plain is not None else decode
            if plain is not None:
                row["decode_ratio"] = decode / base
            for k in drafts:
                if draft is not None and b * (k + 1) > MAX_NUM_SEQS:
                    continue  # (device drafts verify as decode rows only)
                batch = verify_batch(runner, b, CONTEXT, k, on_device=draft is not None)
                reset = reset_device_tokens(runner, b, CONTEXT) if draft is not None else None
                verify = statistics.median(time_step(runner, batch, before=reset))
                row[str(k)] = {"verify_ms": verify, "ratio": verify / base, "as": type(batch).__name__}
                if (name, b, k) in TARGETS:  # where the time goes: one profiled step of each
                    row[str(k)]["profile"] = kind_table(profile_step(
                        lambda: (reset is None or reset(), runner.execute(batch).result())))
                    row["profile"] = kind_table(profile_step(
                        lambda: runner.execute(sampled_decode_batch(runner, b, CONTEXT)).result()))
            rec["steps"][str(b)] = row
            print(f"{name}{'+' + draft if draft else ''} b={b:3d}: decode {decode:.3f} ms; " + ", ".join(
                f"k={k} {row[str(k)]['verify_ms']:.3f} ({row[str(k)]['ratio']:.2f}x)" for k in drafts
                if str(k) in row), flush=True)
        rec["counters"] = dict(vars(runner.counters))
        rec["decode_graph_sizes"] = list(runner.info.decode_graph_sizes)
        llm.close()
    release_cuda_memory()
    return rec


def plain_decode(name: str, batch_sizes: list[int]) -> tuple[dict, dict]:
    """The decode step of an engine without speculation, per batch size (ms), and at the targets' batch sizes one
    profiled step (kinds beside the speculating engine's plain step: what configuring speculation costs)."""
    from nanoserve.bench.decode_step import sampled_decode_batch, time_step
    from nanoserve.bench.profile import kind_table, profile_step

    with tempfile.TemporaryDirectory() as tmp:
        llm, _startup = start_engine(str(write_model_dir(model_config(name), Path(tmp) / "target")), MAX_NUM_SEQS,
                                     4096)
        runner = llm.engine.core.runner
        out = {str(b): statistics.median(time_step(runner, sampled_decode_batch(runner, b, CONTEXT)))
               for b in batch_sizes}
        profiles = {str(b): kind_table(profile_step(
            lambda: runner.execute(sampled_decode_batch(runner, b, CONTEXT)).result()))
            for b in batch_sizes if (name, b) in {(m, tb) for m, tb, _ in TARGETS}}
        llm.close()
    release_cuda_memory()
    print(f"{name} without speculation: " + ", ".join(f"b={b} {ms:.3f} ms" for b, ms in out.items()), flush=True)
    return out, profiles


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
    ap.add_argument("--draft-models", nargs="*", default=[], metavar="TARGET=DRAFT",
                    help="also time TARGET with DRAFT (a shape name) proposing its drafts, e.g. llama-3.1-8b=llama-3.2-1b")
    ap.add_argument("--workload", help="a benchmarks/speculative.py JSON, for the projection")
    ap.add_argument("--plain", action="store_true", help="also each model's decode step without speculation")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    results = {name: measure(name, args.batch_sizes, args.drafts) for name in args.models}
    for name in args.models if args.plain else []:
        plain, results[name]["no_speculation_profile"] = plain_decode(name, args.batch_sizes)
        results[name]["no_speculation_decode_ms"] = plain
        for b, ms in plain.items():
            results[name]["steps"][b]["vs_no_speculation"] = results[name]["steps"][b]["decode_ms"] / ms
    for pair in args.draft_models:
        target, _, draft = pair.partition("=")
        if target not in results:
            raise SystemExit(f"speculative_verify.py: --draft-models {pair}: {target} is not in --models")
        results[f"{target}+{draft}"] = measure(target, args.batch_sizes, args.drafts, draft, results[target])
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
