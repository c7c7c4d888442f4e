"""An fp8 KV cache through the engine on CPU: exactly an fp32 cache whose K/V went through the e4m3 round trip, close
to the model-dtype cache by a stated tolerance, deterministic, the same tokens across tensor parallelism; its blocks
cost about half. (Preemption and prefix-cache hits with fp8 are test_engine's own tests, parametrized over the KV
dtype.)"""
from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import kv_quant, reference
from nanoserve.runner.kv_cache import KVCacheSpec
from nanoserve.tiny import make_tiny_model
from tests.engine.test_engine import GREEDY, assert_two_ranks_give_one_ranks_tokens, prompts_of_lengths

CPU = dict(device="cpu", dtype="float32", block_size=4, max_model_len=160)
# Teacher-forced over the same tokens, fp8 K/V against fp32 K/V on tiny random models of initializer_range 0.1: the
# next-token argmax agrees at >= 95% of positions and a token's logprob moves by < 0.05 on average. Measured (token /
# layer scales): Llama 0.996 / 0.984 and 0.004 / 0.005, Qwen3 0.992 / 0.988 and 0.007 / 0.009, Gemma 2 1.0 / 1.0 and
# 0.031 / 0.040 — no more than serving the same model in bf16 costs (0.964 / 0.988 / 1.0 and 0.004 / 0.004 / 0.059).
# The test models' default range (0.5) makes them chaotic: there bf16 already agrees at only 0.89, so they check
# exactness, not closeness.
MIN_TOP1_AGREEMENT = 0.95
MAX_MEAN_LOGPROB_ERROR = 0.05
CALM_INIT_STD = 0.1


def teacher_forced(path: str, sequences: list[list[int]], **options) -> list[list[tuple[int, float]]]:
    """Per sequence and position after the first: (the argmax token, the logprob of the sequence's token there)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY)
    with LLM(path, **dict(CPU, **options)) as llm:
        outs = llm.generate(sequences, params, use_tqdm=False)
    rows = []
    for seq, out in zip(sequences, outs):
        rows.append([(max(d, key=lambda t: d[t]), d[t]) for d, t in zip(out.prompt_logprobs[1:], seq[1:])])
    return rows


def agreement(ref, got) -> tuple[float, float]:
    """(top-1 agreement, mean |Δ logprob|) over every position."""
    pairs = [(a, b) for r, g in zip(ref, got) for a, b in zip(r, g)]
    top1 = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    return top1, sum(abs(a[1] - b[1]) for a, b in pairs) / len(pairs)


@pytest.fixture(scope="module")
def calm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("calm_models")
    return {arch: str(make_tiny_model(root / arch, arch, initializer_range=CALM_INIT_STD))
            for arch in ("llama", "qwen3", "gemma2")}


@pytest.mark.parametrize("scales", ["token", "layer"])
def test_fp8_kv_is_the_e4m3_round_trip_of_the_cache(tiny_model_dirs, monkeypatch, scales):
    """Every path that stores or reads K/V (fused rotary store, prefill over the cache, decode) sees exactly the
    values an fp32 cache would hold after quantizing each stored K/V row the fp8 way and back — except the keys of a
    query's own block, which it reads exact from the tail: the fp32 run keeps a tail of the exact values too."""
    path = str(tiny_model_dirs["qwen3"])
    sequences = prompts_of_lengths([40, 75, 9], 500, seed=21)
    got = teacher_forced(path, sequences, kv_cache_dtype="fp8", kv_cache_scales=scales)
    store, of = reference.store_kv, KVCacheSpec.of.__func__

    def round_trip(k, v, k_cache, v_cache, slots, kv_scales=None, kv_tail=None, tail_rows=None):
        reference.store_tail(k, v, kv_tail, tail_rows)
        layer = None if scales == "token" else torch.ones(1)
        k, v = (kv_quant.dequantize_ref(*kv_quant.quantize_ref(x, layer)).to(x.dtype) for x in (k, v))
        store(k, v, k_cache, v_cache, slots, kv_scales)

    def with_tail(cls, model, block_size, dtype, scales=None, max_num_seqs=0):
        spec = of(cls, model, block_size, dtype, scales, max_num_seqs)
        return dataclasses.replace(spec, tail_slots=max_num_seqs + 1, tail_dtype=model.dtype)

    monkeypatch.setattr(reference, "store_kv", round_trip)
    monkeypatch.setattr(KVCacheSpec, "of", classmethod(with_tail))
    want = teacher_forced(path, sequences)
    got, want = [p for row in got for p in row], [p for row in want for p in row]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("scales", ["token", "layer"])
def test_fp8_kv_stays_close_to_the_model_dtype_cache(calm_dirs, arch, scales):
    """Gemma 2 (alternating sliding windows, attention-logit soft-cap) reads its fp8 cache through the same kernels."""
    sequences = prompts_of_lengths([40, 75, 130, 9], 500, seed=21)
    ref = teacher_forced(calm_dirs[arch], sequences)
    got = teacher_forced(calm_dirs[arch], sequences, kv_cache_dtype="fp8", kv_cache_scales=scales)
    top1, err = agreement(ref, got)
    assert top1 >= MIN_TOP1_AGREEMENT and 0 < err < MAX_MEAN_LOGPROB_ERROR, (top1, err)


def test_fp8_kv_generation_is_deterministic(tiny_model_dirs):
    prompts = prompts_of_lengths([3, 17, 33], 500, seed=23)
    params = SamplingParams(max_tokens=20, **GREEDY)
    runs = []
    for _ in range(2):
        with LLM(str(tiny_model_dirs["qwen3"]), kv_cache_dtype="fp8", **CPU) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_two_ranks_give_one_ranks_tokens_with_fp8_kv(tiny_model_dirs):
    assert_two_ranks_give_one_ranks_tokens(str(tiny_model_dirs["llama"]),
                                           dict(device="cpu", dtype="float32", kv_cache_dtype="fp8"))


@pytest.mark.parametrize("head_dim,min_ratio", [(128, 1.95), (64, 1.93)])
def test_fp8_blocks_cost_about_half(head_dim, min_ratio):
    """Per-token scales cost 2 bytes per head row: at head_dim 128 the same budget holds >= 1.95x the blocks."""
    bf16 = KVCacheSpec(32, 8, head_dim, 16, torch.bfloat16)
    token = KVCacheSpec(32, 8, head_dim, 16, torch.float8_e4m3fn, "token")
    layer = KVCacheSpec(32, 8, head_dim, 16, torch.float8_e4m3fn, "layer")
    budget = 2 ** 34
    assert (budget // token.block_bytes) / (budget // bf16.block_bytes) >= min_ratio
    assert math.isclose(bf16.block_bytes / layer.block_bytes, 2.0)
    with pytest.raises(ValueError, match="cannot have scales"):
        KVCacheSpec(32, 8, head_dim, 16, torch.bfloat16, "token")


def test_a_checkpoints_kv_scales_serve_as_stored(tiny_model_dirs, tmp_path):
    """"auto" scales follow a checkpoint that carries per-layer KV scales: the cache uses them as stored."""
    from tests.model.test_kv_scale_checkpoints import add_kv_scales, layer_scales

    d = tmp_path / "scaled"
    shutil.copytree(tiny_model_dirs["llama"], d)
    add_kv_scales(d, ("k_scale", "v_scale"))
    with LLM(str(d), kv_cache_dtype="fp8", **CPU) as llm:
        layers = llm.engine.core.runner.model.attention_layers()
        assert [(a.k_scale.item(), a.v_scale.item()) for a in layers] == [layer_scales(i) for i in range(len(layers))]
        assert llm.engine.stats.kv_cache_scales == "layer"
        out = llm.generate(prompts_of_lengths([12], 500, seed=24), SamplingParams(max_tokens=6, **GREEDY),
                           use_tqdm=False)
        assert len(out[0].token_ids) == 6


def test_the_tail_costs_little_beside_the_blocks():
    """The exact tail of each slot's newest two blocks (kernels/kv_quant.py) is a fixed size: at Qwen3-0.6B's shape
    and 256 slots, under 1% of a 100 GiB cache; it exists only for an fp8 cache."""
    qwen3 = type("Shape", (), {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.bfloat16})
    spec = KVCacheSpec.of(qwen3, 16, torch.float8_e4m3fn, "token", max_num_seqs=256)
    assert spec.tail_slots == 257 and spec.tail_bytes == 2 * 28 * 257 * 2 * 16 * 8 * 128 * 2
    assert spec.tail_bytes < 0.01 * 100 * 2**30
    assert KVCacheSpec.of(qwen3, 16, torch.bfloat16, max_num_seqs=256).tail_bytes == 0


def test_prompt_chunks_inside_a_block_stop_at_its_end(tiny_model_dirs):
    """With the tail, a chunk that starts inside a block ends with it (a chunk of several blocks starts on a
    boundary); the tokens equal those of the prompt in one chunk."""
    path = str(tiny_model_dirs["qwen3"])
    prompts = prompts_of_lengths([37, 23], 500, seed=31)
    params = SamplingParams(max_tokens=8, **GREEDY)
    with LLM(path, kv_cache_dtype="fp8", **CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    chunks = []
    with LLM(path, kv_cache_dtype="fp8", max_num_batched_tokens=6, **CPU) as llm:
        schedule = llm.engine.core.scheduler.schedule

        def watched():
            step = schedule()
            chunks.extend((s, n) for s, n, d in zip(step.starts, step.num_new_tokens, step.decode_rows) if not d)
            return step

        llm.engine.core.scheduler.schedule = watched
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    bs = CPU["block_size"]
    assert any(start % bs for start, _ in chunks)
    assert all(start % bs + n <= bs for start, n in chunks if start % bs)


def test_speculation_over_the_tail(tiny_model_dirs):
    """n-gram verifications cross block boundaries (the tail's two banks): the tokens of decoding without drafts;
    more drafts than a block holds are refused in one line."""
    from tests.engine.test_speculative import LOOPING, NGRAM

    path = str(tiny_model_dirs["qwen3"])
    params = SamplingParams(max_tokens=40, **GREEDY)
    with LLM(path, kv_cache_dtype="fp8", **CPU) as llm:
        want = [o.token_ids for o in llm.generate(LOOPING, params, use_tqdm=False)]
    with LLM(path, kv_cache_dtype="fp8", speculative_config=NGRAM, **CPU) as llm:
        assert [o.token_ids for o in llm.generate(LOOPING, params, use_tqdm=False)] == want
        assert llm.engine.stats.spec_accepted_tokens > 0
    with pytest.raises(ValueError, match="num_speculative_tokens=5 with kv_cache_dtype='fp8' must be <= block_size=4"):
        LLM(path, kv_cache_dtype="fp8", speculative_config={**NGRAM, "num_speculative_tokens": 5}, **CPU)
