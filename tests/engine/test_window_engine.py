"""The engine frees the KV blocks that slid out of every layer's window (tiny Mistral, window 10, blocks of 4): greedy
tokens equal transformers' for prompts and generations past the window, with chunked prefill, prefix-cache hits and
preemption in a cache of 16 blocks, while the running sequences hold fewer blocks than their tokens fill. A model
with global layers (Gemma 2 / 3) frees nothing."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.paging import blocks_for
from nanoserve.tiny import TINY_WINDOW
from tests.engine.churn import check_blocks
from tests.engine.test_engine import GREEDY, hf_greedy, prompts_of_lengths

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, max_num_seqs=8,
               max_num_batched_tokens=16, num_kv_blocks=16)


def run(engine, prompts, max_tokens: int, first: int = 0) -> tuple[dict[str, list[int]], int, int]:
    """Run the prompts to the end: (tokens by request id, steps where some block had slid out and was freed, the
    most blocks the running sequences' computed tokens filled minus the blocks in use)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(first + i), p, SamplingParams(max_tokens=max_tokens, **GREEDY), stream=False)
    done, freed_steps, saved = {}, 0, 0
    bm = engine.core.block_manager
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.token_ids
        check_blocks(engine)
        running = engine.core.scheduler.running
        freed_steps += any(bm.placeholder in s.block_table for s in running)
        filled = sum(blocks_for(s.num_computed_tokens, bm.block_size) for s in running)
        saved = max(saved, filled - bm.num_used_blocks)
    return done, freed_steps, saved


def test_windowed_blocks_are_freed_and_tokens_match_transformers(tiny_family_dirs):
    path = str(tiny_family_dirs["mistral"])
    shared = prompts_of_lengths([30], 500, seed=21)[0]
    prompts = [shared + p for p in prompts_of_lengths([3, 11, 6, 14, 1, 9, 2], 500, seed=22)]
    prompts += prompts_of_lengths([23], 500, seed=23)
    expected = hf_greedy(path, prompts, 16)
    with LLM(path, **OPTIONS) as llm:
        engine = llm.engine
        assert engine.core.block_manager.window == TINY_WINDOW
        done, freed_steps, saved = run(engine, prompts[:1], 16)  # its prefix blocks cached, the early ones freed
        more, more_freed, more_saved = run(engine, prompts[1:], 16, first=1)
        assert [done["0"]] + [more[str(i)] for i in range(1, len(prompts))] == expected
        assert freed_steps and more_freed and saved >= 4
        assert more_saved >= OPTIONS["num_kv_blocks"]  # at times the batch's tokens fill twice the pool's blocks
        stats = engine.stats
        assert stats.prefix_cache_hit_tokens >= 28 and stats.preemptions > 0 and stats.mixed_steps > 0
        assert engine.core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_global_layers_free_nothing(name, tiny_family_dirs):
    with LLM(str(tiny_family_dirs[name]), **dict(OPTIONS, num_kv_blocks=32)) as llm:
        engine = llm.engine
        assert engine.core.block_manager.window is None
        _, freed_steps, saved = run(engine, prompts_of_lengths([30, 21], 500, seed=24), 12)
        assert freed_steps == 0 and saved == 0
