"""Offline throughput on nano-vllm's bench.py workload, against that workload's roofline.

The workload (as nano-vllm draws it): random.seed(0); 256 prompts of randint(0, 10000) token ids with
lengths randint(100, 1024); then per prompt SamplingParams(temperature=0.6, ignore_eos=True,
max_tokens=randint(100, 1024)); max_model_len 4096; output tok/s = Σ max_tokens / wall time of one
LLM.generate call (after a warm-up request).

The run itself is `nanoserve bench throughput`'s (nanoserve/bench/offline.py: one LLM.generate, timed).
Roofline: every decode step must read all weights once (of an MoE layer's experts, the expected number its rows
select) plus the K/V of every running sequence (its prompt + what it generated so far), at the copy bandwidth
measured in this run; every prompt token costs 2 × parameters (active parameters for an MoE) FLOPs at the bf16
matmul rate measured in this run. KV bytes per token come from the
engine's own KVCacheSpec, weight bytes from the loaded model's parameters.

    python benchmarks/throughput.py [--models qwen3-0.6b llama-3.1-8b] [--variants async sync] [--out DIR]
                                    [--kv-cache-dtype auto|fp8] [--kv-cache-scales auto|token|layer]

The KV-cache options go to every engine; a run with them writes throughput_kv-fp8[-SCALES].json (throughput.json
with the defaults), and the JSON's settings record them.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (RESULTS_DIR, back_to_back_seconds, env_info, measure_copy_bandwidth,  # noqa: E402
                               model_config, param_counts, release_cuda_memory, write_json, write_model_dir)

VARIANTS = {  # engine options per variant
    "async": dict(async_scheduling=True),
    "async-no-prefill-graphs": dict(async_scheduling=True, prefill_graph_sizes="off"),
    "async-8192": dict(async_scheduling=True, max_num_batched_tokens=8192),  # the offline budget before round 7
    "async-2048": dict(async_scheduling=True, max_num_batched_tokens=2048),  # every step within the token graphs
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
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    return 2 * n ** 3 * iters / back_to_back_seconds(lambda: a @ b, iters)


def weight_bytes_read_per_step(model) -> int:
    """All parameters once, except an untied embedding table (a decode step reads only its b rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    return total - (emb.numel() * emb.element_size() if model.lm_head is not None else 0)


def roofline_seconds(prompts, params, weight_bytes, kv_bytes_per_token: int, num_params: int,
                     bandwidth: float, flops: float) -> dict:
    """weight_bytes: a step's weight bytes, or a function of its rows (an MoE step reads the experts its rows
    select); num_params: the parameters each prompt token multiplies by."""
    lengths = [len(p) for p in prompts]
    outputs = [p.max_tokens for p in params]
    step_bytes = weight_bytes if callable(weight_bytes) else (lambda rows: weight_bytes)
    decode_bytes = 0
    for t in range(1, max(outputs)):  # decode step t: sequences with more than t tokens still to produce
        live = [(n, o) for n, o in zip(lengths, outputs) if o > t]
        decode_bytes += step_bytes(len(live)) + kv_bytes_per_token * sum(n + t for n, _ in live)
    prefill_flops = 2 * num_params * sum(lengths)
    decode_s, prefill_s = decode_bytes / bandwidth, prefill_flops / flops
    return {"decode_seconds": decode_s, "prefill_seconds": prefill_s, "seconds": decode_s + prefill_s}


def output_name(kv_cache_dtype: str = "auto", kv_cache_scales: str = "auto") -> str:
    """throughput.json for the default KV cache, else throughput_kv-DTYPE[-SCALES].json."""
    if kv_cache_dtype == "auto" and kv_cache_scales == "auto":
        return "throughput.json"
    return f"throughput_kv-{kv_cache_dtype}{'' if kv_cache_scales == 'auto' else f'-{kv_cache_scales}'}.json"


def run_variant(model_dir: str, prompts, params, options: dict) -> dict:
    """One `nanoserve bench throughput` run (nanoserve.bench.offline.run_throughput) after nano-vllm's warm-up."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.bench.common import BenchRequest
    from nanoserve.bench.offline import run_throughput

    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              show_progress=False, **options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, as nano-vllm does
    runner = llm.engine.core.runner
    rec = {"kv_blocks": runner.info.num_kv_blocks, "capture_sizes": list(runner.info.decode_graph_sizes),
           "weight_bytes_per_step": weight_bytes_read_per_step(runner.model),
           "kv_bytes_per_token": runner.kv.bytes_per_token,
           "num_params": sum(p.numel() for p in runner.model.parameters())}
    torch.cuda.synchronize()
    requests = [BenchRequest(prompt, len(prompt), p.max_tokens) for prompt, p in zip(prompts, params)]
    result = run_throughput(llm, requests, params, warmup=False, log=lambda line: None)
    stats = llm.engine.stats
    rec.update(seconds=result["elapsed_time"], output_tokens=result["total_output_tokens"],
               output_tokens_per_s=result["output_tokens_per_second"], bench=result,
               stats={f: getattr(stats, f) for f in stats.__struct_fields__})
    llm.close()
    return rec


def measure_model(name: str, variants: list[str], bandwidth: float, flops: float, **engine_options) -> dict:
    """engine_options: added to every variant's (the KV cache's format)."""
    prompts, params = nano_vllm_workload()
    result = {"model": name, "num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "output_tokens_expected": sum(p.max_tokens for p in params), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model_dir(name, tmp))
        for variant in variants:
            try:
                rec = run_variant(model_dir, prompts, params, {**VARIANTS[variant], **engine_options})
            except Exception as e:
                traceback.print_exc()
                result["variants"][variant] = {"error": f"{type(e).__name__}: {e}"}
                continue
            finally:
                release_cuda_memory()  # the engine is garbage once run_variant returns
            if "roofline" not in result:
                weights, num_params = rec["weight_bytes_per_step"], rec["num_params"]
                counts = param_counts(model_config(name))
                if counts.num_experts:  # bf16 experts: the ones a step's rows select; the active parameters
                    weights, num_params = (lambda rows: 2 * counts.decode_read(rows)), counts.active
                result["roofline"] = roofline_seconds(prompts, params, weights, rec["kv_bytes_per_token"], num_params,
                                                      bandwidth, flops)
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
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype (auto | fp8)")
    p.add_argument("--kv-cache-scales", default="auto", help="the engine's kv_cache_scales (auto | token | layer)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("throughput.py needs a CUDA GPU")
        return 0
    bandwidth, flops = measure_copy_bandwidth(), measure_matmul_flops()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    kv = {"kv_cache_dtype": args.kv_cache_dtype, "kv_cache_scales": args.kv_cache_scales}
    report = {"env": env_info(), "bandwidth_bytes_per_s": bandwidth, "matmul_flops": flops, "settings": kv,
              "models": [measure_model(m, args.variants, bandwidth, flops, **kv) for m in args.models]}
    print(f"wrote {write_json(args.out / output_name(**kv), report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
