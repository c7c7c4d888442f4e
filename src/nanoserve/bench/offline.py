"""`nanoserve bench latency` and `nanoserve bench throughput`: the offline engine (LLM) timed end to end.

latency: one batch of --batch-size prompts generated to --output-len tokens, --num-iters times after
--num-iters-warmup untimed runs; each run draws fresh random prompts, so no run reuses another's KV cache
through prefix caching (every run prefills). Reported as `vllm bench latency` does: the mean and percentiles.
throughput: --num-prompts requests in one LLM.generate call (after one short warm-up request), reported as
`vllm bench throughput` does: requests/s, total and output tokens/s. Every request sets ignore_eos, so it
generates exactly its output length.
"""
from __future__ import annotations

import random
import statistics
import time

from nanoserve.bench.common import PERCENTILES, BenchRequest, load_sharegpt, percentile, random_requests


def vocab_size(llm) -> int:
    """The model's vocabulary (random prompt ids are drawn below it)."""
    return llm.engine.vocab_size


def sampling(output_len: int, temperature: float = 1.0):
    """`vllm bench`'s sampling: temperature 1, top-p 1, ignore_eos, exactly output_len tokens."""
    from nanoserve import SamplingParams

    return SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=output_len)


def run_latency(llm, batch_size: int, input_len: int, output_len: int, num_iters: int = 30,
                num_iters_warmup: int = 10, seed: int = 0, temperature: float = 1.0, log=print) -> dict:
    """Seconds per end-to-end batch over num_iters runs: avg_latency, latencies, percentiles (10 … 99)."""
    if batch_size < 1 or num_iters < 1 or num_iters_warmup < 0:
        raise ValueError("--batch-size and --num-iters must be positive, --num-iters-warmup not negative")
    rng, vocab, params = random.Random(seed), vocab_size(llm), sampling(output_len, temperature)
    latencies = []
    for i in range(num_iters_warmup + num_iters):
        prompts = [r.prompt for r in random_requests(rng, batch_size, input_len, output_len, vocab)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # returns once every token is on the host
        if i >= num_iters_warmup:
            latencies.append(time.perf_counter() - start)
    ordered = sorted(latencies)
    result = {"batch_size": batch_size, "input_len": input_len, "output_len": output_len, "num_iters": num_iters,
              "num_iters_warmup": num_iters_warmup, "avg_latency": statistics.fmean(latencies),
              "latencies": latencies, "percentiles": {str(p): percentile(ordered, p) for p in PERCENTILES}}
    log(f"Avg latency: {result['avg_latency']:.6f} seconds")
    for p, value in result["percentiles"].items():
        log(f"{p}% percentile latency: {value:.6f} seconds")
    return result


def profile_batch(llm, batch_size: int, input_len: int, output_len: int, seed: int = 0, log=print) -> dict:
    """One more batch like run_latency's under torch.profiler (CUDA): its kernels' time by kind (bench/profile.py),
    e.g. an MoE model's experts and routing against attention and the rest."""
    from nanoserve.bench.profile import format_kinds, kind_table, profile_step

    rng, vocab, params = random.Random(seed + 1), vocab_size(llm), sampling(output_len)
    prompts = [r.prompt for r in random_requests(rng, batch_size, input_len, output_len, vocab)]
    table = kind_table(profile_step(lambda: llm.generate(prompts, params, use_tqdm=False)))
    for line in format_kinds(table):
        log(line)
    return table


def throughput_requests(llm, num_prompts: int, input_len: int, output_len: int | None,
                        dataset_path: str | None = None, seed: int = 0) -> list[BenchRequest]:
    """The workload: random token ids (input_len in, output_len out), or a ShareGPT file's conversations."""
    if dataset_path:
        return load_sharegpt(dataset_path, llm.tokenizer, num_prompts, output_len, llm.engine.config.max_model_len,
                             seed)
    return random_requests(random.Random(seed), num_prompts, input_len, output_len, vocab_size(llm))


def run_throughput(llm, requests: list[BenchRequest], params=None, warmup: bool = True, log=print) -> dict:
    """One LLM.generate over the requests (params: one SamplingParams per request; default `sampling`)."""
    params = params or [sampling(r.output_len) for r in requests]
    if warmup:  # compiles what a first step needs; not timed
        llm.generate([requests[0].prompt], sampling(2), use_tqdm=False)
    before = llm.engine.stats
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    speculation = llm.engine.stats.speculation_since(before)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {"elapsed_time": seconds, "num_requests": len(requests), "total_input_tokens": prompt_tokens,
              "total_output_tokens": output_tokens, "total_num_tokens": prompt_tokens + output_tokens,
              "requests_per_second": len(requests) / seconds,
              "tokens_per_second": (prompt_tokens + output_tokens) / seconds,
              "output_tokens_per_second": output_tokens / seconds}
    log(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
        f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    if speculation is not None:
        result["speculation"] = speculation
        log(f"Speculation ({speculation['method']}): {speculation['accepted_tokens']} of {speculation['draft_tokens']} "
            f"drafts accepted ({speculation['acceptance_rate']:.1%}), {speculation['mean_accepted_length']:.2f} tokens "
            "per verifying sequence step")
    return result


__all__ = ["profile_batch", "run_latency", "run_throughput", "throughput_requests", "sampling", "vocab_size"]
