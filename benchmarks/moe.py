"""Mixture-of-experts targets (issue 35) on real shapes with random weights, each against its floor, in one run.

    python benchmarks/moe.py qwen3 [--out DIR]     # Qwen3-30B-A3B shape: every target below
    python benchmarks/moe.py mixtral [--out DIR]   # Mixtral-8x7B shape (93 GB of bf16): loads, decodes from graphs

Per model (a fresh process each, so the other's memory is gone):
  * start-up: engine wall time, graph capture seconds (decode, sampler, token-count graphs);
  * decode `engine.step()`-equivalent (ModelRunner.execute of a forward-only batch, the graph replay the engine
    runs) at 512-token contexts, b = 1 / 8 / 64 / 256, against its floor: the weights the step's rows select
    (benchmarks.common.ParamCounts.decode_read: attention, head, the expected experts) + their K/V, at the copy
    bandwidth measured here; with one profiled step's kernel kinds (experts, routing, attention, the rest);
  * TTFT of one 1024-token prompt (LLM.generate(max_tokens=1) wall, median of 5) against its FLOP floor
    (2 × active parameters × tokens at the bf16 matmul rate measured here), with its step profile;
  * the expert products of an 8 × 2048-token prefill (two 8192-token budget steps): kernels/moe.py's grouped path
    on 8192 routed rows of the real layer shape, its FLOP rate against the measured matmul rate;
  * nano-vllm's 256-sequence workload (benchmarks/throughput.py's run) against its MoE roofline.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (RESULTS_DIR, back_to_back_seconds, decode_steps, env_info,  # noqa: E402
                               measure_copy_bandwidth, model_config, param_counts, start_engine, write_json,
                               write_model_dir)
from nanoserve.bench.profile import kind_table, profile_step  # noqa: E402
from benchmarks.throughput import measure_matmul_flops, measure_model  # noqa: E402

SHAPES = {"qwen3": "qwen3-30b-a3b", "mixtral": "mixtral-8x7b"}


def ttft(llm, counts, tokens: int, flops: float) -> dict:
    from nanoserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    walls = []
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        prompt = torch.randint(10, 30000, (tokens,), generator=g).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        walls.append(1e3 * (time.perf_counter() - start))
    def fresh():  # a new prompt each call: a repeated one would hit the prefix cache and profile a 16-token step
        return torch.randint(10, 30000, (tokens,), generator=g).tolist()

    table = kind_table(profile_step(lambda p=fresh(): llm.generate([p], params, use_tqdm=False)))
    host = _host_profile(lambda p=fresh(): llm.generate([p], params, use_tqdm=False))
    floor_ms = 1e3 * 2 * counts.active * tokens / flops
    median = statistics.median(walls[1:])
    print(f"  TTFT {tokens} tokens: {median:.2f} ms (FLOP floor {floor_ms:.2f} ms, {median / floor_ms:.2f}x)", flush=True)
    return {"tokens": tokens, "wall_ms": walls[1:], "median_ms": median, "flop_floor_ms": floor_ms, "profile": table,
            "host_profile": host}


def _host_profile(run) -> list:
    """The host functions one call spends its time in (cProfile, by own time): where a wall time far above the GPU
    span goes."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = [(f"{func[0].rsplit('/', 1)[-1]}:{func[1]}:{func[2]}", calls, round(1e3 * tottime, 3), round(1e3 * cum, 3))
            for func, (_, calls, tottime, cum, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r[2])[:20]


def expert_gemm_rate(cfg: dict, tokens: int, flops: float) -> dict:
    """kernels/moe.py's grouped path on `tokens` routed rows of one real MoE layer (random router logits)."""
    from nanoserve.kernels import moe

    h, inter = cfg["hidden_size"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    experts, top_k = cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_experts_per_tok"]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(experts, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(experts, h, inter, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    weights, ids = moe.route(torch.randn(tokens, experts, device="cuda", generator=g), top_k, True)
    iters = 20
    seconds = back_to_back_seconds(lambda: moe.grouped_experts(x, w13, w2, weights, ids), iters) / iters
    expert_flops = 2 * tokens * top_k * 3 * h * inter
    table = kind_table(profile_step(lambda: moe.grouped_experts(x, w13, w2, weights, ids)))
    gemm_us = table["kinds"]["experts"]["sum_us"]
    rate = expert_flops / (gemm_us * 1e-6) if gemm_us else 0.0
    print(f"  expert GEMMs, {tokens} tokens: {1e3 * seconds:.3f} ms a layer in all, GEMM kernels {gemm_us:.0f} us = "
          f"{rate / 1e12:.0f} TFLOP/s ({100 * rate / flops:.0f}% of the matmul rate)", flush=True)
    return {"tokens": tokens, "layer_ms": 1e3 * seconds, "gemm_us": gemm_us, "expert_flops": expert_flops,
            "gemm_tflops": rate / 1e12, "fraction_of_matmul_rate": rate / flops, "profile": table}


def prefill_batch(llm, num: int, tokens: int) -> dict:
    from nanoserve import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 30000, (tokens,), generator=g).tolist() for _ in range(num)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompts[:1], params, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(f"  prefill {num} x {tokens}: {1e3 * wall:.1f} ms = {num * tokens / wall:.0f} tok/s", flush=True)
    return {"prompts": num, "tokens": tokens, "wall_ms": 1e3 * wall, "tokens_per_s": num * tokens / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=sorted(SHAPES))
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--decode-only", action="store_true", help="start-up and decode steps only (kernel experiments)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe.py needs a CUDA GPU")
        return 0
    name = SHAPES[args.model]
    cfg, counts = model_config(name), param_counts(model_config(name))
    bandwidth, flops = measure_copy_bandwidth(), measure_matmul_flops()
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    report = {"env": env_info(), "model": name, "bandwidth_bytes_per_s": bandwidth, "matmul_flops": flops,
              "params_total": counts.total, "params_active": counts.active}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model_dir(name, tmp))
        llm, report["startup"] = start_engine(model_dir, 256)
        print(f"  start-up {report['startup']['engine_start_s']:.1f} s, capture {report['startup']['capture_s']:.2f} s",
              flush=True)
        report["decode"] = decode_steps(llm, counts, cfg, args.batch_sizes, bandwidth)
        if args.model == "qwen3" and not args.decode_only:
            report["ttft"] = ttft(llm, counts, 1024, flops)
            report["prefill_8x2048"] = prefill_batch(llm, 8, 2048)
            report["expert_gemm_8192"] = expert_gemm_rate(cfg, 8192, flops)
        llm.close()
        del llm
    if args.model == "qwen3" and not (args.skip_throughput or args.decode_only):
        torch.cuda.empty_cache()
        report["throughput"] = measure_model(name, ["async"], bandwidth, flops)
    print(f"wrote {write_json(args.out / f'moe_{args.model}.json', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
