"""A churn workload for engine-equivalence tests: requests join at random steps, leave by EOS-like stop ids,
stop strings, max_tokens or aborts; greedy and seeded rows only, so the tokens may not depend on what
else is batched (or on whether the host runs a step ahead)."""
from __future__ import annotations

import random

from nanoserve import SamplingParams


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["greedy", "stop_id", "seeded", "stop_str", "min_tokens", "logprobs"])
    common = dict(max_tokens=rng.randrange(1, 40), ignore_eos=True)
    if kind == "stop_id":
        return SamplingParams(temperature=0.0, stop_token_ids=rng.sample(range(3, vocab), 40), **common)
    if kind == "seeded":
        return SamplingParams(temperature=0.9, top_p=0.95, seed=rng.randrange(1000), **common)
    if kind == "stop_str":
        return SamplingParams(temperature=0.0, stop=[rng.choice("aeiou"), "th"], **common)
    if kind == "min_tokens":
        return SamplingParams(temperature=0.0, min_tokens=min(3, common["max_tokens"]), stop_token_ids=rng.sample(range(3, vocab), 80), **common)
    if kind == "logprobs":
        return SamplingParams(temperature=0.0, logprobs=2, **common)
    return SamplingParams(temperature=0.0, **common)


def check_blocks(engine) -> None:
    bm = engine.core.block_manager
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    held = {b for s in engine.core.scheduler.running for b in s.block_table} - {bm.placeholder}
    assert bm.num_used_blocks == len(held)
    assert all(not s.block_table for s in engine.core.scheduler.waiting)


def run_churn(engine, steps: int, seed: int = 0, max_requests: int = 300, params=random_params):
    """→ ({request id: (token ids, finish reason)} of every request that was not aborted, final stats).
    params(rng, vocab): each request's SamplingParams."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple[list[int], str]] = {}
    aborted: set[str] = set()
    next_id = 0

    def take(outputs):
        for out in outputs:
            assert out.request_id not in finished, f"{out.request_id} reported after it finished"
            assert out.request_id not in aborted or out.request_id in tokens
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finished[out.request_id] = (tokens.pop(out.request_id), out.finish_reason)

    for _ in range(steps):
        if next_id < max_requests and rng.random() < 0.5:
            for _ in range(rng.choice([1, 1, 2, 5])):
                rid = str(next_id)
                next_id += 1
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 48))]
                engine.add_request(rid, prompt, params(rng, vocab))
                tokens[rid] = []
        if next_id and rng.random() < 0.05:  # the choice must not depend on timing: any id, live or not
            rid = str(rng.randrange(next_id))
            engine.abort_request(rid)
            aborted.add(rid)
            tokens.pop(rid, None)
            finished.pop(rid, None)
        take(engine.step())
        check_blocks(engine)
    while engine.has_unfinished_requests():
        take(engine.step())
        check_blocks(engine)
    assert not tokens, f"requests lost: {sorted(tokens)}"
    assert set(finished) | aborted == {str(i) for i in range(next_id)}
    finished = {rid: v for rid, v in finished.items() if rid not in aborted}
    assert engine.core.block_manager.num_used_blocks == 0
    return finished, engine.stats


def run_chunked_batch(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """The first prompt through LLM.generate (it fills the prefix cache), then the rest added at once and stepped to
    the end with the block accounting checked every step: each prompt's tokens, in order."""
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    for i, p in enumerate(prompts[1:]):
        llm.engine.add_request(str(i), p, params, stream=False)
    done = step_to_end(llm.engine)
    return [first[0].token_ids] + [done[str(i)] for i in range(len(prompts) - 1)]


def step_to_end(engine) -> dict[str, list[int]]:
    """Step until every request finished, the block accounting checked after each step: tokens by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.token_ids
        check_blocks(engine)
    return done
