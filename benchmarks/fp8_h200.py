"""FP8 weights on the H200, in one run (~4 minutes): GPU tests, fp8 GEMV sweep, prefill choice, decode and prefill.

    OUT=/path python benchmarks/fp8_h200.py        # or: python benchmarks/fp8_h200.py --out /path

1. the fp8 GPU tests (test_gpu_* of tests/kernels/test_fp8.py and tests/model/test_quantization.py): the fp8 GEMV
   and every fused path against the dequantized reference on real shapes, _scaled_mm, CUDA-graph replay == eager,
   logits and greedy tokens near bf16;
2. benchmarks/gemv.py --fp8, short: the fp8 GEMV variants vs the library path, printing FP8_GEMV_TABLE;
3. benchmarks/fp8_prefill.py: torch._scaled_mm vs dequantize + cuBLAS at 512..8192 tokens, printing PREFILL_TABLE;
4. benchmarks/decode_latency.py --quantization fp8: graph replay at context 512, b = 1 and 32, Qwen3-0.6B and
   Llama-3.1-8B, against issue 11's targets;
5. one 8 x 1024-token prefill step through the engine (Llama-3.1-8B shape, random weights), bf16 and fp8.
Every stage runs in its own process under a time limit; a failing stage is reported and the run goes on.
Writes to OUT: run.log, gemv_fp8.json, fp8_prefill.json, decode_latency_fp8.json, prefill_step_<q>.json,
summary.json (targets met or missed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import read_json, stage  # noqa: E402

TARGETS_MS = {("llama-3.1-8b", 1): 2.3, ("llama-3.1-8b", 32): 3.2, ("qwen3-0.6b", 1): 0.55}  # issue 11
BF16_MS = {("llama-3.1-8b", 1): 4.26, ("llama-3.1-8b", 32): 5.35, ("qwen3-0.6b", 1): 1.00,
           ("qwen3-0.6b", 32): 1.71}  # before issue 9's kernels (notes/PERF.md); the bf16 baseline to beat
PREFILL_TARGET = 0.9  # fp8 prefill tokens/s >= 0.9x bf16's
PREFILL_MODEL, PREFILL_SEQS, PREFILL_LEN, PREFILL_REPEATS = "llama-3.1-8b", 8, 1024, 3


def prefill_step(quantization: str | None, out: Path) -> None:
    """In its own process: ms of one engine step that prefills PREFILL_SEQS prompts of PREFILL_LEN tokens."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.common import model_config, synchronize, write_model_dir
    from nanoserve import LLM, SamplingParams

    cfg = model_config(PREFILL_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(write_model_dir(cfg, tmp)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_num_seqs=PREFILL_SEQS, max_model_len=2048, max_num_batched_tokens=PREFILL_SEQS * PREFILL_LEN,
                  num_kv_blocks=PREFILL_SEQS * PREFILL_LEN // 16 * 2 + 2, enforce_eager=True,
                  enable_prefix_caching=False, show_progress=False, quantization=quantization)
    engine = llm.engine
    weight = engine.core.runner.model.model.layers[0].mlp.down_proj.weight
    if quantization and weight.dtype != torch.float8_e4m3fn:
        raise SystemExit(f"quantization={quantization} but the engine's weights are {weight.dtype}: ModelRunner must "
                         "pass config.quantization / quantize_lm_head to load_model")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    for run in range(PREFILL_REPEATS + 1):  # the first run compiles and warms up
        for i in range(PREFILL_SEQS):
            prompt = torch.randint(0, cfg["vocab_size"], (PREFILL_LEN,), generator=gen).tolist()
            engine.add_request(f"r{run}-{i}", prompt, params)
        synchronize("cuda")
        t = time.perf_counter()
        engine.step()  # the whole batch fits the token budget: one prefill step
        synchronize("cuda")
        if run:
            samples.append((time.perf_counter() - t) * 1e3)
        while engine.core.scheduler.waiting or engine.core.scheduler.running:
            engine.step()
    ms = statistics.median(samples)
    out.write_text(json.dumps({"model": PREFILL_MODEL, "quantization": quantization, "seqs": PREFILL_SEQS,
                               "tokens_per_seq": PREFILL_LEN, "step_ms": ms, "samples_ms": samples,
                               "tokens_per_s": PREFILL_SEQS * PREFILL_LEN / ms * 1e3}, indent=2) + "\n")
    print(f"prefill step {PREFILL_SEQS}x{PREFILL_LEN} ({quantization or 'bf16'}): {ms:.1f} ms")


def summarize(out: Path, stages: list[dict]) -> dict:
    summary: dict = {"stages": stages, "decode": [], "prefill": None, "gemv_table": None, "prefill_table": None}
    decode = read_json(out / "decode_latency_fp8.json") or {}
    for model in decode.get("models", []):
        for rec in model.get("decode", []):
            key = (model["model"], rec["batch_size"])
            target = TARGETS_MS.get(key)
            graph = rec.get("graph_ms")
            summary["decode"].append({"model": key[0], "b": key[1], "graph_ms": graph, "floor_ms": rec.get("floor_ms"),
                                      "target_ms": target, "bf16_before_ms": BF16_MS.get(key),
                                      "met": None if target is None or graph is None else graph <= target,
                                      "argmax_agree_replay_vs_eager": rec.get("argmax_agree"),
                                      "error": rec.get("error") or model.get("error")})
    steps = {q: read_json(out / f"prefill_step_{q}.json") for q in ("bf16", "fp8")}
    if all(steps.values()):
        ratio = steps["fp8"]["tokens_per_s"] / steps["bf16"]["tokens_per_s"]
        summary["prefill"] = {"bf16_ms": steps["bf16"]["step_ms"], "fp8_ms": steps["fp8"]["step_ms"],
                              "fp8_over_bf16_throughput": ratio, "target": PREFILL_TARGET,
                              "met": ratio >= PREFILL_TARGET}
    summary["gemv_table"] = (read_json(out / "gemv_fp8.json") or {}).get("table_source")
    summary["gemv_summary"] = (read_json(out / "gemv_fp8.json") or {}).get("summary")
    summary["prefill_table"] = (read_json(out / "fp8_prefill.json") or {}).get("table_source")
    return summary


def print_table(summary: dict) -> None:
    print("\n================ summary ================")
    for s in summary["stages"]:
        print(f"  {s['stage']:<22} exit {s['exit']}  {s['seconds']} s")
    print(f"\n{'model':<14}{'b':>4}{'bf16 before':>12}{'fp8 graph':>10}{'floor':>8}{'target':>8}  met")
    for r in summary["decode"]:
        fmt = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(f"{r['model']:<14}{r['b']:>4}{fmt(r['bf16_before_ms']):>12}{fmt(r['graph_ms']):>10}"
              f"{fmt(r['floor_ms']):>8}{fmt(r['target_ms']):>8}  {r['met']}  {r['error'] or ''}")
    p = summary["prefill"]
    if p:
        print(f"\nprefill {PREFILL_SEQS}x{PREFILL_LEN} ({PREFILL_MODEL}): bf16 {p['bf16_ms']:.1f} ms, "
              f"fp8 {p['fp8_ms']:.1f} ms: fp8/bf16 throughput {p['fp8_over_bf16_throughput']:.3f} "
              f"(target >= {PREFILL_TARGET}) met {p['met']}")
    for name in ("gemv_table", "prefill_table"):
        if summary[name]:
            print(f"\n{name} to paste:\n{summary[name]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/nanoserve-fp8")))
    p.add_argument("--skip", nargs="*", default=[], choices=["tests", "gemv", "prefill-table", "decode", "prefill"])
    p.add_argument("--prefill-step", choices=["bf16", "fp8"], help=argparse.SUPPRESS)  # one stage, run by main
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.prefill_step:
        prefill_step(None if args.prefill_step == "bf16" else "fp8", out / f"prefill_step_{args.prefill_step}.json")
        return 0
    py, stages = sys.executable, []
    with open(out / "run.log", "a") as log:
        if "tests" not in args.skip:
            # the test_gpu_* cases (real shapes, PDL, graphs); `pytest -m gpu tests/kernels` also compiles every
            # interpreter case for the GPU, which takes minutes
            stages.append(stage("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-k", "gpu", "-p",
                                              "no:cacheprovider", "tests/kernels/test_fp8.py",
                                              "tests/model/test_quantization.py"], 90, log))
        if "gemv" not in args.skip:
            stages.append(stage("fp8 gemv sweep", [py, "benchmarks/gemv.py", str(out / "gemv_fp8.json"), "--fp8",
                                                   "--m", "1,4,16,64", "--budget-s", "40"], 55, log))
        if "prefill-table" not in args.skip:
            stages.append(stage("prefill table", [py, "benchmarks/fp8_prefill.py", str(out / "fp8_prefill.json"),
                                                  "--tokens", "512", "2048", "8192"], 35, log))
        if "decode" not in args.skip:
            stages.append(stage("decode fp8", [py, "benchmarks/decode_latency.py", "--quantization", "fp8",
                                               "--models", "qwen3-0.6b", "llama-3.1-8b", "--batch-sizes", "1", "32",
                                               "--e2e-batch-sizes", "--no-plot", "--out", str(out)], 75, log))
        if "prefill" not in args.skip:
            for q in ("bf16", "fp8"):
                stages.append(stage(f"prefill step {q}", [py, "benchmarks/fp8_h200.py", "--out", str(out),
                                                          "--prefill-step", q], 45, log))
    summary = summarize(out, stages)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    return 0 if all(s["exit"] == 0 for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
