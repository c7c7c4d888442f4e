"""Asynchronous scheduling (the host one step ahead of the device) gives exactly the synchronous engine's
tokens, under churn and under preemption, with exact block accounting after every step (CPU)."""
from __future__ import annotations

import gc
import weakref

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.churn import check_blocks, run_churn

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, max_num_seqs=12)


@pytest.mark.parametrize("num_kv_blocks, chunk", [(400, 2048), (60, 2048), (400, 16)],
                         ids=["roomy", "preempting", "chunked"])
def test_async_equals_sync_under_churn(tiny_model_dirs, num_kv_blocks, chunk):
    path = str(tiny_model_dirs["qwen3"])
    runs = {}
    for overlap in (True, False):
        llm = LLM(path, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=chunk, async_scheduling=overlap, **OPTIONS)
        runs[overlap] = run_churn(llm.engine, steps=150, seed=num_kv_blocks + chunk)
    (got, stats), (want, _) = runs[True], runs[False]
    assert got == want
    reasons = {reason for _, reason in got.values()}
    assert {"stop", "length"} <= reasons
    if num_kv_blocks == 60:
        assert stats.preemptions > 0
    if chunk == 16:
        assert stats.mixed_steps > 0


def test_a_finished_sequence_discards_its_extra_token(tiny_model_dirs):
    """The step after an EOS is already running when the host learns of the EOS: that token never shows."""
    path = str(tiny_model_dirs["qwen2"])
    llm = LLM(path, async_scheduling=True, **OPTIONS)
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    stop = base.token_ids[4]
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen += out.token_ids
        check_blocks(engine)
    assert seen == base.token_ids[:base.token_ids.index(stop) + 1]
    assert engine.stats.generation_tokens >= len(seen)  # the discarded token is not an output


def test_a_deleted_engine_is_collected(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    ref = weakref.ref(llm.engine.core.runner.buffers.kv_cache)
    del llm
    gc.collect()
    assert ref() is None
