"""Mixture-of-experts models through the whole engine (CPU, float32): greedy tokens equal transformers' for batches of
prompts of different lengths, in chunks, after prefix-cache hits and through preemption; the asynchronous loop equals
the synchronous one; two gloo ranks (experts split by their intermediate columns) give one rank's tokens."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.tiny import MOE_ARCHS
from tests.engine.test_engine import (GREEDY, assert_batch_matches_transformers, assert_two_ranks_give_one_ranks_tokens,
                                     chunked_prefix_batch_stats, prompts_of_lengths)

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, max_num_seqs=8)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_greedy_matches_transformers(arch, tiny_moe_dirs):
    assert_batch_matches_transformers(str(tiny_moe_dirs[arch]), OPTIONS)


def test_chunks_prefix_hits_and_preemption_match_transformers(tiny_moe_dirs):
    stats = chunked_prefix_batch_stats(str(tiny_moe_dirs["qwen3_moe"]), OPTIONS)
    assert stats.prefix_cache_hit_tokens >= 32 and stats.preemptions > 0 and stats.mixed_steps > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_loop_equals_sync(tiny_moe_dirs, async_scheduling):
    path = str(tiny_moe_dirs["qwen2_moe"])
    prompts = prompts_of_lengths([3, 8, 21], 500, seed=8)
    params = [SamplingParams(max_tokens=9, **GREEDY), SamplingParams(max_tokens=9, temperature=0.8, seed=3,
                                                                     ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.0, top_k=5, seed=4, ignore_eos=True)]
    with LLM(path, async_scheduling=False, **OPTIONS) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, async_scheduling=async_scheduling, **OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def test_two_ranks_give_the_one_rank_tokens(tiny_moe_dirs):
    path = str(tiny_moe_dirs["qwen2_moe"])  # routed experts and the shared expert both split
    assert_two_ranks_give_one_ranks_tokens(path, OPTIONS)
