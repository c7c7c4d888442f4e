"""Drafting on the device (n-gram, issue 38): the asynchronous loop keeps running while drafts are verified — the
host schedules a step before it reads the one in flight, and the tokens equal the synchronous loop's and decoding
without speculation; the device's token histories equal what the host knows, prefix-cache hits included."""
from __future__ import annotations

from nanoserve import LLM, SamplingParams
from tests.engine.test_speculative import LOOPING, NGRAM, OPTIONS

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _drive(llm, prompts, params, prefix: str = "") -> tuple[dict, int]:
    """Run the prompts through engine steps by hand: ({request id: token ids}, how many steps were scheduled while a
    step verifying drafts was in flight, unread)."""
    core, tokens, overlapped = llm.engine.core, {}, []
    schedule = core.scheduler.schedule

    def watched():
        overlapped.append(any(any(f.step.drafts) for f in core._pipeline._inflight))
        return schedule()

    core.scheduler.schedule = watched
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"{prefix}{i}", p, params)
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, sum(overlapped)


def test_async_device_drafts_equal_sync_and_no_speculation(tiny_model_dirs):
    path = str(tiny_model_dirs["qwen3"])
    base = [o.token_ids for o in LLM(path, **OPTIONS).generate(LOOPING, GREEDY, use_tqdm=False)]
    for async_scheduling in (False, True):
        llm = LLM(path, speculative_config=NGRAM, async_scheduling=async_scheduling, **OPTIONS)
        tokens, overlapped = _drive(llm, LOOPING, GREEDY)
        assert list(tokens.values()) == base
        stats = llm.engine.stats
        assert stats.spec_accepted_tokens > 0 and stats.generation_tokens == sum(map(len, base))
        assert (overlapped > 0) == async_scheduling  # drafts verified with the next step already scheduled
        assert llm.engine.core.block_manager.num_used_blocks == 0


def test_device_histories_hold_the_known_tokens(tiny_model_dirs):
    """While sequences run (the second time over prefix-cache hits), each slot's device history and count equal the
    prompt and outputs the host has read, once every step in flight is read."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=NGRAM, **OPTIONS)
    core = llm.engine.core
    drafting = core.runner.buffers.state.drafting
    for round_ in range(2):
        for i, p in enumerate(LOOPING):
            llm.engine.add_request(f"{round_}-{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        for _ in range(6):
            core.step()
        core._read_all()
        running = [s for s in core.scheduler.running if s.decoding]
        assert running
        for seq in running:
            known = seq.prompt_token_ids + seq.output_token_ids
            assert int(drafting.hist_len[seq.slot]) == len(known)
            assert drafting.history[seq.slot, :len(known)].tolist() == known
        if round_ == 1:
            assert core.scheduler.num_prefix_hit_tokens > 0
        while core.has_unfinished_requests():
            core.step()
