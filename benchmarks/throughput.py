"""Offline throughput on nano-vllm's bench.py workload, against that workload's roofline.

The workload (as nano-vllm draws it): random.seed(0); 256 prompts of randint(0, 10000) token ids with
lengths randint(100, 1024); then per prompt SamplingParams(temperature=0.6, ignore_eos=True,
max_tokens=randint(100, 1024)); max_model_len 4096; output tok/s = Σ max_tokens / wall time of one
LLM.generate call (after a warm-up request).

Roofline: every decode step must read all weights once plus the K/V of every running sequence (its
prompt + what it generated so far), at the copy bandwidth measured in this run; every prompt token costs
2 × parameters FLOPs at the bf16 matmul rate measured in this run. KV bytes per token come from the
engine's own KVCacheSpec, weight bytes from the loaded model's parameters.

    python benchmarks/throughput.py [--models qwen3-0.6b llama-3.1-8b] [--variants async sync] [--out DIR]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR, env_info, measure_copy_bandwidth, model_config, release_cuda_memory, write_json, write_model_dir)

VARIANTS = {  # engine options per variant
    "async": dict(async_scheduling=True),
    "async-no-prefill-graphs": dict(async_scheduling=True, prefill_graph_sizes="off"),
    "sync": dict(async_scheduling=False),
}


def nano_vllm_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024):
    from nanoserve import SamplingParams

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def measure_matmul_flops(device: str = "cuda", n: int = 8192, iters: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * iters / (start.elapsed_time(end) / 1e3)


def weight_bytes_read_per_step(model) -> int:
    """All parameters once, except an untied embedding table (a decode step reads only its b rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def roofline_seconds(prompts, params, weight_bytes: int, kv_bytes_per_token: int, num_params: int,
                     bandwidth: float, flops: float) -> dict:
    lengths = [len(p) for p in prompts]
    outputs = [p.max_tokens for p in params]
    decode_bytes = 0
    for t in range(1, max(outputs)):  # decode step t: sequences with more than t tokens still to produce
        live = [(n, o) for n, o in zip(lengths, outputs) if o > t]
        decode_bytes += weight_bytes + kv_bytes_per_token * sum(n + t for n, _ in live)
    prefill_flops = 2 * num_params * sum(lengths)
    decode_s, prefill_s = decode_bytes / bandwidth, prefill_flops / flops
    return {"decode_seconds": decode_s, "prefill_seconds": prefill_s, "seconds": decode_s + prefill_s}


def run_variant(model_dir: str, prompts, params, options: dict) -> dict:
    """One LLM.generate-equivalent run (the engine's own loop, so each step's wall time and rows are recorded)."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              show_progress=False, **options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, as nano-vllm does
    engine = llm.engine
    runner = engine.model_runner
    rec = {"kv_blocks": runner.num_kv_blocks, "capture_sizes": runner.graph_runner.capture_sizes if runner.graph_runner else [],
           "weight_bytes_per_step": weight_bytes_read_per_step(runner.model),
           "kv_bytes_per_token": runner.kv.bytes_per_token,
           "num_params": sum(p.numel() for p in runner.model.parameters())}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p, stream=False)
    generated, trace, mixed_ms, last = 0, {}, [], time.perf_counter()
    allocator = torch.cuda.memory_stats()
    seen = (runner.prefill_steps_graph, runner.prefill_steps_eager)
    while engine.has_unfinished_requests():
        rows = len(engine.scheduler.running)
        outs = engine.step()
        generated += sum(len(o.token_ids) for o in outs)
        now = time.perf_counter()
        key = _step_kind(runner, seen, rows)
        if key.startswith("mixed"):
            mixed_ms.append(round((now - last) * 1e3, 1))
        seen = (runner.prefill_steps_graph, runner.prefill_steps_eager)
        steps, ms = trace.get(key, (0, 0.0))
        trace[key] = (steps + 1, ms + (now - last) * 1e3)
        last = now
    seconds = time.perf_counter() - t0
    after = torch.cuda.memory_stats()
    rec["allocator"] = {k: after.get(k, 0) - allocator.get(k, 0) for k in
                        ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
    rec["mixed_step_ms"] = mixed_ms
    stats = engine.stats
    rec.update(seconds=seconds, output_tokens=generated, output_tokens_per_s=generated / seconds,
               stats={f: getattr(stats, f) for f in stats.__struct_fields__},
               step_trace={k: {"steps": n, "ms": round(ms, 1), "ms_per_step": round(ms / n, 3)}
                           for k, (n, ms) in sorted(trace.items(), key=lambda kv: str(kv[0]))})
    return rec


def _step_kind(runner, seen: tuple[int, int], rows: int) -> str:
    """What the step just run was: a prompt / mixed step (graph or eager) or a decode step of so many rows.
    The core runs one step ahead, so the host time of step N is attributed to the step launched during it."""
    if runner.prefill_steps_graph > seen[0]:
        return "mixed graph"
    if runner.prefill_steps_eager > seen[1]:
        return "mixed eager"
    return "decode " + _rows_bucket(rows)


def _rows_bucket(rows: int) -> str:
    """Running rows in ranges of 32, for the per-step trace."""
    low = (max(rows - 1, 0) // 32) * 32
    return f"rows {low + 1:3d}-{low + 32:3d}"


def measure_model(name: str, variants: list[str], bandwidth: float, flops: float) -> dict:
    cfg = model_config(name)
    prompts, params = nano_vllm_workload()
    result = {"model": name, "num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "output_tokens_expected": sum(p.max_tokens for p in params), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model_dir(cfg, tmp))
        for variant in variants:
            try:
                rec = run_variant(model_dir, prompts, params, VARIANTS[variant])
            except Exception as e:
                traceback.print_exc()
                result["variants"][variant] = {"error": f"{type(e).__name__}: {e}"}
                continue
            finally:
                release_cuda_memory()  # the engine is garbage once run_variant returns
            if "roofline" not in result:
                result["roofline"] = roofline_seconds(prompts, params, rec["weight_bytes_per_step"],
                                                      rec["kv_bytes_per_token"], rec["num_params"], bandwidth, flops)
                result["roofline"]["tokens_per_s"] = result["output_tokens_expected"] / result["roofline"]["seconds"]
            rec["fraction_of_roofline"] = result["roofline"]["seconds"] / rec["seconds"]
            result["variants"][variant] = rec
            print(f"{name:14s} {variant:16s} {rec['output_tokens_per_s']:9.0f} tok/s  {rec['seconds']:6.2f} s  "
                  f"{100 * rec['fraction_of_roofline']:5.1f}% of roofline "
                  f"({result['roofline']['tokens_per_s']:.0f} tok/s)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--variants", nargs="+", default=["async", "sync"], choices=sorted(VARIANTS))
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("throughput.py needs a CUDA GPU")
        return 0
    bandwidth, flops = measure_copy_bandwidth(), measure_matmul_flops()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    report = {"env": env_info(), "bandwidth_bytes_per_s": bandwidth, "matmul_flops": flops,
              "models": [measure_model(m, args.variants, bandwidth, flops) for m in args.models]}
    print(f"wrote {write_json(args.out / 'throughput.json', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
