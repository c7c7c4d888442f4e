"""The dense families' targets (issue 36) on real shapes with random bf16 weights, each against its Llama twin and
its floor, in one run.

    python benchmarks/families.py gemma3 [--out DIR]    # Gemma-3-4B shape: every target below → families_gemma3.json
    python benchmarks/families.py mistral [--out DIR]   # Mistral-7B shape (no 8k window step) → families_mistral.json
    python benchmarks/families.py all [--out DIR]       # both, one after the other (longer than one 10-minute call)

Per family:
  * decode `engine.step()`-equivalent (common.decode_steps: the graph replay the engine runs, launched back to back as
    the engine's steps are) at 512-token contexts, b = 1 / 64, against its floor (the weights a step reads, a tied
    head whole, + the K/V it reads, at the copy bandwidth measured here) and against the same step of its Llama twin
    (llama_twin: the same bytes per step as a plain LlamaForCausalLM). Targets: family / twin ≤ 1.15 at each b,
    step / floor ≤ 1.3 at b = 1;
  * Gemma 3 only: b = 16 at 8k-token contexts with its windows and with them ignored (without_windows: every layer
    full attention), with the K/V bytes each reads (common.kv_bytes_read). Target: windowed / unwindowed ≤ 0.5;
  * nano-vllm's workload (benchmarks/throughput.py) as `nanoserve bench throughput` runs it ("async", 8192-token
    budget: prompt steps above config.PREFILL_GRAPH_MAX_TOKENS run eagerly by design) and with a 2048-token budget
    ("async-2048": every step ≤ 2048 tokens, so its eager prompt steps are the target's count). The engine's stats
    count eager prompt steps of every size; target: 0 in the 2048 run.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DECODE_CONTEXT, RESULTS_DIR, check, decode_steps, env_info,  # noqa: E402
                               kv_bytes_per_token, measure_copy_bandwidth, model_config, model_spec, param_counts,
                               release_cuda_memory, start_engine, text_part, write_json, write_model_dir)
from benchmarks.throughput import VARIANTS, measure_matmul_flops, measure_model, nano_vllm_workload  # noqa: E402

SHAPES = {"gemma3": "gemma-3-4b", "mistral": "mistral-7b"}
WINDOWED = ("gemma3",)  # the families whose local layers a long-context step tests (Mistral's window spans 4096)
BATCH_SIZES = [1, 64]
LONG_CONTEXT, LONG_ROWS = 8192, 16
MAX_MODEL_LEN, LONG_MAX_MODEL_LEN = 4096, LONG_CONTEXT + 256  # the engines' (as moe.py's; room for 8k rows)
THROUGHPUT_VARIANTS = ["async", "async-2048"]
TWIN_RATIO_MAX, FLOOR_RATIO_MAX, WINDOW_RATIO_MAX = 1.15, 1.3, 0.5  # issue 36's targets
# What the twin copies: everything that sets a step's bytes (the rest is Llama's plain defaults).
_TWIN_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "rms_norm_eps", "bos_token_id", "eos_token_id")


def llama_twin(cfg: dict) -> dict:
    """A LlamaForCausalLM config of the same bytes per step as `cfg` (a multimodal one's text model): its sizes,
    head_dim and tied / untied head, but none of the family's extras (windows, soft-caps, sandwich and q/k norms,
    GeGLU), RoPE plain."""
    text, spec = text_part(cfg), model_spec(cfg)
    twin = {k: text.get(k, cfg.get(k)) for k in _TWIN_FIELDS}
    twin.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=spec.head_dim,
                tie_word_embeddings=spec.tie_word_embeddings, max_position_embeddings=spec.max_position_embeddings,
                hidden_act="silu", attention_bias=False, mlp_bias=False, rope_theta=10000.0, torch_dtype="bfloat16")
    return {k: v for k, v in twin.items() if v is not None}


def without_windows(cfg: dict) -> dict:
    """`cfg` with every layer full attention (layer_types all "full_attention", no sliding_window): the step with
    the windows ignored, everything else the same."""
    out = copy.deepcopy(cfg)
    text = text_part(out)
    text.pop("sliding_window_pattern", None)
    text.update(layer_types=["full_attention"] * text["num_hidden_layers"], sliding_window=None)
    return out


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def targets(report: dict) -> dict:
    """Issue 36's targets read off a report: each ratio, its limit and whether it holds (None where not measured)."""
    out = {}
    for rows, step in report.get("decode", {}).items():
        twin = report.get("twin_decode", {}).get(rows)
        if twin:
            out[f"twin_ratio_b{rows}"] = check(ratio(step["step_ms"], twin["step_ms"]), TWIN_RATIO_MAX)
        if rows == "1":
            out["floor_ratio_b1"] = check(ratio(step["step_ms"], step["floor_ms"]), FLOOR_RATIO_MAX)
    long = report.get("long_context")
    if long:
        out["window_ratio"] = check(ratio(long["windowed"]["step_ms"], long["no_windows"]["step_ms"]),
                                     WINDOW_RATIO_MAX)
    graphs = report.get("prompt_graphs", {}).get("async-2048")
    if graphs and graphs.get("prefill_steps_eager") is not None:
        out["eager_prompt_steps_le_2048"] = check(graphs["prefill_steps_eager"], 0)
    return out


def measure_decode(cfg: dict, bandwidth: float, rows_list: list[int], context: int, max_model_len: int) -> dict:
    """A fresh engine on cfg's shape (dummy weights): start-up and decode steps at `context` tokens a row."""
    counts = param_counts(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        llm, startup = start_engine(str(write_model_dir(cfg, tmp)), max(rows_list), max_model_len)
        try:
            steps = decode_steps(llm, counts, cfg, rows_list, bandwidth, context)
        finally:
            llm.close()
            del llm
            release_cuda_memory()
    return {"startup": startup, "params_total": counts.total, "decode_read_b1": counts.decode_read(1),
            "kv_bytes_per_token": kv_bytes_per_token(cfg), "decode": steps}


def prompt_graphs(throughput: dict) -> dict:
    """Per variant: the engine's prompt-step counters (of every step size: the stats do not split them), the
    variant's token budget (the largest a step can be), the workload's largest prompt and the graphs' token limit."""
    from nanoserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, PREFILL_GRAPH_MAX_TOKENS

    prompts, _ = nano_vllm_workload()
    out = {}
    for variant, rec in throughput.get("variants", {}).items():
        stats = rec.get("stats", {})
        out[variant] = {k: stats.get(k) for k in ("prefill_steps_eager", "prefill_steps_graph", "mixed_steps")}
        budget = VARIANTS[variant].get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        out[variant].update(budget=budget, largest_prompt=max(map(len, prompts)),
                            graph_max_tokens=PREFILL_GRAPH_MAX_TOKENS, error=rec.get("error"))
    return out


def measure_family(family: str, bandwidth: float, flops: float, skip_throughput: bool) -> dict:
    name = SHAPES[family]
    cfg, twin = model_config(name), llama_twin(model_config(name))
    report = {"model": name, "twin_config": twin, "bandwidth_bytes_per_s": bandwidth, "matmul_flops": flops}
    print(f"{name}:", flush=True)
    own = measure_decode(cfg, bandwidth, BATCH_SIZES, DECODE_CONTEXT, MAX_MODEL_LEN)
    report.update(startup=own["startup"], params_total=own["params_total"], decode=own["decode"])
    print(f"{name} Llama twin:", flush=True)
    report["twin"] = measure_decode(twin, bandwidth, BATCH_SIZES, DECODE_CONTEXT, MAX_MODEL_LEN)
    report["twin_decode"] = report["twin"].pop("decode")
    if family in WINDOWED:
        print(f"{name} at {LONG_CONTEXT} tokens, b = {LONG_ROWS}, with windows / without:", flush=True)
        windowed, full = (measure_decode(c, bandwidth, [LONG_ROWS], LONG_CONTEXT, LONG_MAX_MODEL_LEN)
                          for c in (cfg, without_windows(cfg)))
        report["long_context"] = {"rows": LONG_ROWS, "context": LONG_CONTEXT,
                                  "windowed": windowed["decode"][str(LONG_ROWS)],
                                  "no_windows": full["decode"][str(LONG_ROWS)]}  # each with the K/V bytes it reads
    if not skip_throughput:
        report["throughput"] = measure_model(name, THROUGHPUT_VARIANTS, bandwidth, flops)
        report["prompt_graphs"] = prompt_graphs(report["throughput"])
    report["targets"] = targets(report)
    for key, target in report["targets"].items():
        print(f"  {key}: {target['value']} (limit {target['limit']}) {'met' if target['met'] else 'NOT met'}",
              flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=sorted(SHAPES) + ["all"])
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("families.py needs a CUDA GPU")
        return 0
    bandwidth, flops = measure_copy_bandwidth(), measure_matmul_flops()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    for family in sorted(SHAPES) if args.family == "all" else [args.family]:
        report = {"env": env_info(), **measure_family(family, bandwidth, flops, args.skip_throughput)}
        print(f"wrote {write_json(args.out / f'families_{family}.json', report)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
