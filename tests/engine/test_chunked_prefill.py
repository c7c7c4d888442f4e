"""Chunked prefill: a per-step token budget below the prompt length. Greedy tokens equal transformers'
(fp32) for prompts spanning 1-4 chunks, with prefix-cache hits and with preemption mid-prefill; running
sequences keep decoding while a long prompt is prefilled; every block is free at the end (CPU)."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.scheduler import chunk_caps
from nanoserve.runner.startup.bucket_plan import StepCurve
from tests.engine.churn import check_blocks, step_to_end
from tests.engine.test_engine import GREEDY, hf_greedy, prompts_of_lengths

CHUNK = 16
OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=CHUNK)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prompts_match_transformers(arch, tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs[arch]), **OPTIONS)
    prompts = prompts_of_lengths([5, 16, 31, 60], llm.engine.vocab_size, seed=11)  # 1, 1, 2 and 4 chunks
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = hf_greedy(tiny_model_dirs[arch], prompts, 12)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.stats.mixed_steps >= 7  # 1 + 1 + 2 + 4 chunks at most 16 tokens a step
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_decodes_continue_while_a_long_prompt_is_chunked(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), **OPTIONS)
    engine = llm.engine
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(3):
        engine.step()
    engine.add_request("long", prompts_of_lengths([100], engine.vocab_size)[0], SamplingParams(max_tokens=2, **GREEDY))
    produced = 0
    for _ in range(7):  # the long prompt needs 7 chunks; the short request gains a token in every one
        produced += sum(len(o.token_ids) for o in engine.step() if o.request_id == "short")
        check_blocks(engine)
    assert produced >= 6
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.block_manager.num_used_blocks == 0


def test_prefix_hits_inside_chunked_prefill(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    llm = LLM(str(path), **OPTIONS)
    shared = prompts_of_lengths([41], llm.engine.vocab_size, seed=5)[0]
    prompts = [shared + [7, 8, 9], shared + [10] * 20, shared]
    params = SamplingParams(max_tokens=8, **GREEDY)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hit_tokens >= 2 * 40
    assert [o.token_ids for o in first + rest] == hf_greedy(path, prompts, 8)
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_preemption_mid_prefill(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    prompts = prompts_of_lengths([50, 45, 60, 38, 52], 500, seed=9)
    params = SamplingParams(max_tokens=20, **GREEDY)
    tight = LLM(str(path), num_kv_blocks=40, enable_prefix_caching=False, **OPTIONS)
    engine = tight.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, stream=False)
    done = step_to_end(engine)
    assert engine.stats.preemptions > 0
    assert [done[str(i)] for i in range(len(prompts))] == hf_greedy(path, prompts, 20)
    assert engine.core.block_manager.num_used_blocks == 0


def test_budget_below_max_model_len_is_legal(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen2"]), device="cpu", max_model_len=256, max_num_batched_tokens=8)
    out = llm.generate([list(range(3, 203))], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert len(out.token_ids) == 3



def test_prompt_token_caps_bound_the_chunks_beside_decode_rows(tiny_model_dirs, monkeypatch):
    """chunk_time_ratio's caps (set here by hand; the engine derives them from measured curves on a GPU): a step
    that decodes carries at most caps[rows] prompt tokens, a step with nothing to decode the whole budget, and the
    tokens stay transformers'."""
    path = tiny_model_dirs["qwen3"]
    llm = LLM(str(path), **{**OPTIONS, "max_num_batched_tokens": 64})
    scheduler = llm.engine.core.scheduler
    scheduler.prompt_token_caps = [64] + [5] * 8
    steps = []
    schedule = scheduler.schedule
    monkeypatch.setattr(scheduler, "schedule", lambda: steps.append(schedule()) or steps[-1])
    prompts = prompts_of_lengths([3, 40, 50], llm.engine.vocab_size, seed=4)
    params = SamplingParams(max_tokens=12, **GREEDY)
    outs = [llm.generate(prompts[:1], params, use_tqdm=False)[0]]
    for i, p in enumerate(prompts):  # all three at once: the first step decodes nothing
        llm.engine.add_request(str(i), p, params, stream=False)
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
    mixed = [(sum(n for n, d in zip(s.num_new_tokens, s.decode_rows) if not d), sum(s.decode_rows)) for s in steps]
    assert mixed[0] == (3, 0)  # the first request alone: nothing decodes, no cap
    assert all(prompt <= 5 for prompt, rows in mixed if rows) and any(rows and prompt == 5 for prompt, rows in mixed)
    assert any(prompt > 5 for prompt, rows in mixed[1:] if not rows)  # nothing decoding: the whole budget
    expected = hf_greedy(path, prompts, 12)
    assert [done[str(i)] for i in range(3)] == expected and outs[0].token_ids == expected[0]


def test_chunk_caps_keep_a_step_within_ratio_decode_steps():
    decode = StepCurve.fit({1: 1.0, 256: 3.56})  # 1 + 0.01 (d - 1) ms
    tokens = StepCurve.fit({16: 1.045, 2048: 7.141})  # 1 + 0.003 t ms
    caps = chunk_caps(tokens, decode, 256, 2048, ratio=2.5)
    assert len(caps) == 257 and caps[0] == 2048  # nothing decodes: the whole budget
    for d in (1, 16, 64):
        chunk = caps[d]
        assert tokens(d + chunk) <= 2.5 * decode(d) + 1e-9 < tokens(d + chunk + 1)  # the most that fits
    assert caps[1] < caps[16] < caps[64] < caps[200] == 2048 - 200  # more rows: a larger chunk, up to the budget
    assert chunk_caps(tokens, decode, 256, 2048, ratio=1.0)[1] == 16  # the floor: prompts still progress
    assert chunk_caps(tokens, decode, 256, 512, ratio=100)[256] == 512 - 256  # the budget left by the rows
