"""Speculative decoding with a draft model (issue 38) on CPU: a smaller model's greedy drafts, proposed on the device
inside the target's decode step, verified exactly. Greedy outputs equal decoding without speculation (under churn,
preemption, chunked prompts, prefix-cache hits, stops, penalties, token-count graph inputs, async and sync); a model
drafting for itself has every draft accepted (its mirrored KV cache holds what the target's holds); sampled outputs
keep the distribution; bad settings are one-line errors."""
from __future__ import annotations

import re

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.draft_plan import VerifyCost, plan_drafts
from nanoserve.engine.preflight import check_engine_config
from nanoserve.tiny import make_tiny_model
from tests.engine.churn import check_blocks, run_churn
from tests.engine.test_speculative import (LOOPING, OPTIONS, _chi_square_p, _pooled, assert_ends_mid_run,
                                          greedy_params)
from tests.engine.test_speculative_device import _drive

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def draft_spec(path: str, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize("num_kv_blocks, chunk", [(400, 2048), (70, 2048), (400, 12)],
                         ids=["roomy", "preempting", "chunked"])
def test_greedy_equals_no_speculation_under_churn(drafts, num_kv_blocks, chunk, monkeypatch):
    """Requests join and leave at random steps: drafts are verified beside prompt chunks too (token-count steps)."""
    from nanoserve.runner.draft_model import DraftModel
    beside_prompts, original = [], DraftModel.propose_tokens
    monkeypatch.setattr(DraftModel, "propose_tokens",
                        lambda self, *a: (beside_prompts.append(1), original(self, *a))[1])
    runs = {}
    for spec in (None, draft_spec(drafts["noisy"])):
        llm = LLM(drafts["target"], num_kv_blocks=num_kv_blocks, max_num_batched_tokens=chunk,
                  speculative_config=spec, **OPTIONS)
        runs[spec is not None] = run_churn(llm.engine, steps=120, seed=num_kv_blocks + chunk, params=greedy_params)
        check_blocks(llm.engine)
    (got, stats), (want, _) = runs[True], runs[False]
    assert got == want
    assert stats.spec_method == "draft_model"
    assert 0 < stats.spec_accepted_tokens == sum(stats.spec_accepted_per_position) < stats.spec_draft_tokens
    assert beside_prompts
    if num_kv_blocks == 70:
        assert stats.preemptions > 0


@pytest.mark.parametrize("async_scheduling, kv", [(True, "auto"), (False, "auto"), (True, "fp8")],
                         ids=["async", "sync", "fp8-kv"])
def test_a_model_drafting_for_itself_is_always_accepted(drafts, async_scheduling, kv):
    """Every draft is accepted, prefix-cache hits included (the second pass), so the draft's mirrored cache holds the
    target's tokens (an fp8 cache too); the asynchronous loop schedules steps while drafts are verified; max_tokens
    and stop ids inside an accepted run end it exactly there."""
    opts = {**OPTIONS, "kv_cache_dtype": kv}
    base = [o.token_ids for o in LLM(drafts["target"], **opts).generate(LOOPING, GREEDY, use_tqdm=False)]
    llm = LLM(drafts["target"], speculative_config=draft_spec(drafts["self"]), async_scheduling=async_scheduling,
              **opts)
    for round_ in range(2):
        tokens, overlapped = _drive(llm, LOOPING, GREEDY, prefix=f"{round_}-")
        assert list(tokens.values()) == base
        assert (overlapped > 0) == async_scheduling
    stats = llm.engine.stats
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert_ends_mid_run(llm, base)
    check_blocks(llm.engine)
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_unrelated_drafts_penalties_and_token_graph_inputs_keep_tokens(drafts):
    """A draft that is never right, requests with penalties (no drafts while one runs) beside plain ones, and prompts
    through the token-count graphs' static inputs (the draft mirrors those steps too) give the same tokens."""
    params = [GREEDY, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.2,
                                     presence_penalty=0.3, logit_bias={7: 2.0})]
    graphs = dict(prefill_graph_sizes=[4, 8, 12, 16, 24, 32, 48, 64], max_num_batched_tokens=64)
    outs = []
    for spec, extra in ((None, {}), (draft_spec(drafts["other"]), {}), (draft_spec(drafts["self"]), graphs)):
        llm = LLM(drafts["target"], speculative_config=spec, **OPTIONS, **extra)
        outs.append([[o.token_ids for o in llm.generate(LOOPING, p, use_tqdm=False)] for p in params])
        stats = llm.engine.stats
        if spec is not None:
            assert stats.spec_draft_tokens > 0
            assert (stats.spec_accepted_tokens == 0) == (spec["model"] == drafts["other"])
        if extra:
            assert stats.prefill_steps_graph > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert outs[0] == outs[1] == outs[2]


def test_sampled_outputs_keep_the_distribution(drafts):
    """Temperature 1 over each position's 3 likeliest tokens: the joint law of the first four tokens is the same with
    the noisy draft's greedy drafts verified (one-hot drafts: runner/speculative.py). 100 waves of 12 requests: 12
    sequences and their drafts fit one decode batch of 64 rows."""
    p = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    counts = []
    for setting in (None, draft_spec(drafts["noisy"], adaptive=False)):
        llm = LLM(drafts["target"], speculative_config=setting, enable_prefix_caching=False,
                  **{**OPTIONS, "max_num_seqs": 64})
        seen: dict = {}
        for _ in range(100):
            for o in llm.generate([LOOPING[0]] * 12, p, use_tqdm=False):
                seen[tuple(o.token_ids)] = seen.get(tuple(o.token_ids), 0) + 1
        counts.append(seen)
        if setting is not None:
            stats = llm.engine.stats
            assert 0.1 * stats.spec_draft_tokens < stats.spec_accepted_tokens < 0.9 * stats.spec_draft_tokens
    assert len(counts[0]) > 10
    assert _chi_square_p(*_pooled(counts)) > 1e-3


def test_seeded_sampling_is_reproducible(drafts):
    llm = LLM(drafts["target"], speculative_config=draft_spec(drafts["noisy"]), **OPTIONS)
    p = SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=7, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(LOOPING, p, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(LOOPING[::-1], p, use_tqdm=False)] == first[::-1]


def test_the_kv_budget_holds_both_caches(drafts):
    """On the CPU budget a block holds the target's KV and the draft's: drafting for itself halves the blocks."""
    budget = dict(cpu_kv_cache_gb=0.0002, max_model_len=64, max_num_seqs=64)
    opts = {**OPTIONS, **budget}
    plain = LLM(drafts["target"], **opts).engine.core.info.num_kv_blocks
    both = LLM(drafts["target"], speculative_config=draft_spec(drafts["self"]), **opts).engine.core.info.num_kv_blocks
    assert both == plain // 2


def test_bad_draft_models_are_one_line_errors(drafts, tmp_path):
    big = make_tiny_model(tmp_path / "big", "qwen3", vocab_size=600)
    short = make_tiny_model(tmp_path / "short", "qwen3", max_position_embeddings=64)
    cases = [(draft_spec(str(big)), "vocabulary (600 tokens) is larger than the model's (512)"),
             (draft_spec(str(short)), "reaches 64 tokens, fewer than max_model_len=128"),
             (draft_spec(str(tmp_path / "missing")), "the draft model"),
             ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
             ({"method": "draft_model", "model": drafts["self"]}, "needs num_speculative_tokens"),
             ({**draft_spec(drafts["self"]), "prompt_lookup_max": 2}, "do not apply")]
    cases.append((draft_spec(drafts["self"]), "a draft model runs with tensor_parallel_size=1 only"))
    for i, (spec, message) in enumerate(cases):
        tp = 2 if i == len(cases) - 1 else 1
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            check_engine_config(EngineConfig(model=drafts["target"], device="cpu", max_model_len=128,
                                             speculative_config=spec, tensor_parallel_size=tp))
        assert "\n" not in str(e.value)


def test_smollm2_drafting_for_itself(smollm2_gguf):
    """The real SmolLM2-135M-Instruct drafting for itself (the issue's exactness check): the same greedy tokens as
    without speculation, a chat prompt and a copy prompt, nearly every draft accepted (the draft's single-row steps
    and the target's verification rows may round a near tie apart)."""
    prompts = ["<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nRepeat exactly: the quick brown fox jumps over the lazy dog.<|im_end|>\n"
               "<|im_start|>assistant\n"]
    opts = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4, show_progress=False)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    base = [o.token_ids for o in LLM(str(smollm2_gguf), **opts).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(smollm2_gguf), speculative_config=draft_spec(str(smollm2_gguf)), **opts)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == base
    stats = llm.engine.stats
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens


def test_plan_weighs_the_draft_models_forwards():
    """A decode step that verifies a draft model's drafts costs its own curve (Kind.DRAFT), a plain one the decode
    curve: drafts are planned only where the expected tokens pay for the draft's forwards."""
    flat = lambda rows: 1.0 + 0.0 * rows  # noqa: E731
    costly = lambda rows: 3.0 + 0.0 * rows  # noqa: E731 (the draft's k forwards triple the step)
    cheap = lambda rows: 1.2 + 0.0 * rows  # noqa: E731
    assert plan_drafts([4], [0.5], flat, flat, max_decode_rows=8, verify=VerifyCost(costly)) == [0]  # ≤ 1.94 for 3×
    assert plan_drafts([4], [0.9], flat, flat, max_decode_rows=8, verify=VerifyCost(costly)) == [4]  # 4.1 for 3×
    assert plan_drafts([4], [0.5], flat, flat, max_decode_rows=8, verify=VerifyCost(cheap)) == [4]


def test_a_step_that_proposes_nothing_skips_the_draft(drafts, monkeypatch):
    """Requests with penalties get no drafts, so the draft model's proposal does not run (its mirror does)."""
    from nanoserve.runner.draft_model import DraftModel
    calls = {"propose": 0, "mirror": 0}
    for name in calls:
        original = getattr(DraftModel, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(DraftModel, name, counted)
    llm = LLM(drafts["target"], speculative_config=draft_spec(drafts["self"]), **OPTIONS)
    penalized = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.2)
    llm.generate(LOOPING, penalized, use_tqdm=False)
    assert calls["propose"] == 0 and calls["mirror"] > 0 and llm.engine.stats.spec_draft_tokens == 0
    llm.generate(LOOPING, GREEDY, use_tqdm=False)
    assert calls["propose"] > 0


def test_a_verification_step_on_its_own(drafts):
    """bench/decode_step.verify_batch with device drafts, as speculative_verify.py times it: a model drafting for
    itself proposes, at each draft row, the sample the target draws there (greedy); each run keeps every token (the
    slots' device counts grow by k + 1) and the reset puts the counts back."""
    from nanoserve.bench.decode_step import reset_device_tokens, verify_batch
    llm = LLM(drafts["target"], speculative_config=draft_spec(drafts["self"]), **OPTIONS)
    runner = llm.engine.core.runner
    llm.generate(LOOPING, GREEDY, use_tqdm=False)  # (the cache holds real tokens; the batch reuses its blocks)
    rows, context, k = 2, 20, 4  # (10 rows: one decode batch of max_num_seqs 12)
    batch = verify_batch(runner, rows, context, k, on_device=True)
    reset, hist_len = reset_device_tokens(runner, rows, context), runner.buffers.state.drafting.hist_len
    for _ in range(2):
        reset()
        assert hist_len[:rows].tolist() == [context] * rows
        result = runner.execute(batch).result()
        for r in range(rows):
            group = slice(r * (k + 1), (r + 1) * (k + 1))
            samples, proposed = result.token_ids[group], result.draft_ids[group]
            assert proposed[:k] == samples[:k] and proposed[k] == -1
        assert hist_len[:rows].tolist() == [context + k + 1] * rows


def test_sampled_requests_draw_their_drafts_from_the_draft(drafts):
    """At temperature 1 a model drafting for itself draws each draft from the distribution the model samples, so
    rejection sampling against it keeps nearly all of them (greedy drafts keep only the samples that hit the argmax);
    seeded requests keep greedy drafts (their draws stay their own, reproducible)."""
    llm = LLM(drafts["target"], speculative_config=draft_spec(drafts["self"], adaptive=False), **OPTIONS)

    def acceptance(params) -> float:
        before = llm.engine.stats
        llm.generate(LOOPING * 2, params, use_tqdm=False)
        after = llm.engine.stats
        return ((after.spec_accepted_tokens - before.spec_accepted_tokens)
                / (after.spec_draft_tokens - before.spec_draft_tokens))

    sampled = acceptance(SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    seeded = acceptance(SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True, seed=3))
    assert sampled > 0.9 > seeded
