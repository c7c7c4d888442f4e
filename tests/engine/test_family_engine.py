"""The dense families through the whole engine (CPU, float32, block_size 4 under a window of 10): greedy tokens equal
transformers' for batches of prompts shorter and longer than the window; chunked prefill across the window edge,
prefix-cache hits and preemption; two gloo ranks give one rank's tokens for a windowed, soft-capped family."""
from __future__ import annotations

import pytest

from tests.conftest import FAMILIES
from tests.engine.test_engine import (assert_batch_matches_transformers, assert_two_ranks_give_one_ranks_tokens,
                                     chunked_prefix_batch_stats)

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, max_num_seqs=8)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_greedy_matches_transformers(name, tiny_family_dirs):
    assert_batch_matches_transformers(str(tiny_family_dirs[name]), OPTIONS)


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_chunks_prefix_hits_and_preemption_match_transformers(name, tiny_family_dirs):
    """Chunks of 16 tokens over windows of 10 (a chunk's queries see keys of the chunk before), a cached prefix of 33
    tokens (past the window), and a KV cache small enough to preempt Gemma 3
    (its global layers keep every block; Mistral frees what slid out of its window)."""
    stats = chunked_prefix_batch_stats(str(tiny_family_dirs[name]), OPTIONS)
    assert stats.prefix_cache_hit_tokens >= 32 and stats.mixed_steps > 0
    # Mistral's blocks that slid out of its window are freed: the same cache holds the batch without preempting
    assert (stats.preemptions > 0) == (name == "gemma3")


def test_two_ranks_give_the_one_rank_tokens(tiny_family_dirs):
    path = str(tiny_family_dirs["gemma2"])  # windowed layers, attention and final soft-caps, tied embeddings
    assert_two_ranks_give_one_ranks_tokens(path, OPTIONS)
