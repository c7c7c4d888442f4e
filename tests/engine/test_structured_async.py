"""The constrained async loop (a step with grammar rows: forward launched, the next step scheduled and built, then
the step before read, the masks filled, the sampler launched) gives exactly the synchronous loop's tokens: greedy
and seeded rows, constrained and free ones mixed, grammars that end early, max_tokens, stop ids, min_tokens,
aborts, n > 1 and preemption under KV pressure; the scheduler is two steps ahead of the constrained rows, and
every KV block is back on the free list at the end (CPU)."""
from __future__ import annotations

import dataclasses
import random
import re
import threading

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.core import EngineCore
from nanoserve.engine.output import child_id
from nanoserve.engine.scheduler import Scheduler
from tests.engine.churn import check_blocks, random_params, run_churn

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, max_num_seqs=12, show_progress=False)
CONSTRAINTS = [{"regex": "[a-c]{5,30}"}, {"regex": "(ab|c)+d"}, {"choice": ["xy", "z", "hello world"]},
               {"regex": "[0-9]{1,3}"}, {"regex": "[a-z ]{1,60}"}]


def constrained_params(rng: random.Random, vocab: int) -> SamplingParams:
    """The churn's params (greedy, seeded, stop ids, stop strings, min_tokens, logprobs), most under a grammar."""
    params = random_params(rng, vocab)
    if rng.random() < 0.7:
        params = dataclasses.replace(params, structured_outputs=rng.choice(CONSTRAINTS))
    return params


@pytest.fixture
def pending_seen(monkeypatch) -> list[int]:
    """The most tokens any running sequence had on the device after each schedule: 1 synchronously, 2 with the
    free async loop (one step ahead), 3 with a constrained row (steps N, N+1 on the device as N+2 is scheduled)."""
    seen = []
    original = Scheduler.schedule

    def schedule(self):
        step = original(self)
        seen.append(max((s.num_pending for s in self.running), default=0))
        return step

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    return seen


@pytest.mark.parametrize("num_kv_blocks, fill_thread_rows", [(400, None), (60, None), (400, 1)],
                         ids=["roomy", "preempting", "every-fill-on-its-thread"])
def test_constrained_churn_async_equals_sync(tiny_model_dirs, pending_seen, num_kv_blocks, fill_thread_rows,
                                             monkeypatch):
    """fill_thread_rows: the fewest grammar rows whose masks fill on the mask thread (None: config's)."""
    from nanoserve.engine import grammar

    if fill_thread_rows is not None:
        monkeypatch.setattr(grammar, "GRAMMAR_FILL_THREAD_MIN_ROWS", fill_thread_rows)
    on_thread = []
    original_fill = grammar.Grammars._fill
    monkeypatch.setattr(grammar.Grammars, "_fill", lambda self, m, rows: on_thread.append(
        threading.current_thread().name == "nanoserve-mask") or original_fill(self, m, rows))
    runs = {}
    for overlap in (True, False):
        pending_seen.clear()
        with LLM(str(tiny_model_dirs["qwen3"]), num_kv_blocks=num_kv_blocks, async_scheduling=overlap,
                 **OPTIONS) as llm:
            runs[overlap] = run_churn(llm.engine, steps=120, seed=num_kv_blocks, params=constrained_params)
            bm = llm.engine.core.block_manager
            assert bm.num_free_blocks == bm.num_blocks and not llm.engine.core.has_unfinished_requests()
        assert max(pending_seen) == (3 if overlap else 1)
    (got, stats), (want, _) = runs[True], runs[False]
    assert got == want
    assert {"stop", "length"} <= {reason for _, reason in got.values()}
    if num_kv_blocks == 60:
        assert stats.preemptions > 0
    if fill_thread_rows == 1:
        assert on_thread and all(on_thread)


def _launched_rows(monkeypatch) -> dict[str, int]:
    """core request id (child_id) → the launched steps that sample it (each a token produced on the device)."""
    rows: dict[str, int] = {}
    original = EngineCore._launch

    def launch(self, step, batch, overlap):
        for seq, samples in zip(step.seqs, step.samples):
            rows[seq.request_id] = rows.get(seq.request_id, 0) + samples
        return original(self, step, batch, overlap)

    monkeypatch.setattr(EngineCore, "_launch", launch)
    return rows


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], abort: tuple[str, int] | None = None):
    """Run the requests to the end (aborting abort[0] once it has abort[1] tokens), checking the blocks after every
    step: request id → (token ids, finish reason), and the aborted request's pending tokens when it was aborted."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in requests}
    reasons, pending_at_abort = {}, None
    while engine.has_unfinished_requests():
        if abort is not None and pending_at_abort is None and len(tokens[abort[0]]) >= abort[1]:
            pending_at_abort = engine.core.sequences[child_id(abort[0], 0)].num_pending
            engine.abort_request(abort[0])
        for out in engine.step():
            assert out.request_id not in reasons, f"{out.request_id} reported after it finished"
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        check_blocks(engine)
    while engine.core.has_unfinished_requests():  # a step launched for rows that ended meanwhile
        assert not engine.step()
    bm = engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return {rid: (tokens[rid], reasons.get(rid)) for rid in requests}, pending_at_abort


def test_a_constrained_row_ended_two_steps_back_discards_both_tokens(tiny_model_dirs, monkeypatch):
    """A stop id read at step N: the row is already in the launched steps N+1 and N+2 (a free row keeps them
    running); both tokens are discarded, the blocks come back, and max_tokens rows sample exactly max_tokens."""
    grammar = {"regex": "[a-z ]{1,80}"}
    base_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, structured_outputs=grammar)
    with LLM(str(tiny_model_dirs["qwen2"]), num_kv_blocks=200, **OPTIONS) as llm:
        base = llm.generate([5, 6, 7], base_params, use_tqdm=False)[0]
    assert base.finish_reason == "length"
    stop = base.token_ids[4]
    want = base.token_ids[:base.token_ids.index(stop) + 1]
    requests = {"r": ([5, 6, 7], dataclasses.replace(base_params, stop_token_ids=[stop])),
                "long": ([9, 10], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
                "seeded": ([11, 12, 13], SamplingParams(temperature=0.8, seed=3, max_tokens=9, min_tokens=9,
                                                         structured_outputs=grammar))}
    results, rows = {}, {}
    for overlap in (True, False):
        rows[overlap] = _launched_rows(monkeypatch)
        with LLM(str(tiny_model_dirs["qwen2"]), num_kv_blocks=200, async_scheduling=overlap, **OPTIONS) as llm:
            results[overlap], _ = _run(llm.engine, requests)
        monkeypatch.undo()
    assert results[True] == results[False]
    assert results[True]["r"] == (want, "stop")
    r = child_id("r", 0)
    assert rows[True][r] == len(want) + 2 and rows[False][r] == len(want)  # two discarded, never shown
    for rid, n in (("long", 20), ("seeded", 9)):  # lengths are known on the host: never an extra token
        assert results[True][rid] == (results[True][rid][0], "length") and len(results[True][rid][0]) == n
        assert rows[True][child_id(rid, 0)] == rows[False][child_id(rid, 0)] == n


def test_abort_mid_run_with_two_steps_in_flight(tiny_model_dirs):
    """Aborted between steps with two tokens on the device: no output follows, its blocks come back, the other
    rows (free, constrained, n=2 seeded, min_tokens) get the synchronous loop's tokens."""
    requests = {
        "victim": ([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                               structured_outputs={"regex": "[a-c]{5,40}"})),
        "free": ([6, 7], SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)),
        "pair": ([8, 9, 10], SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=20, ignore_eos=True,
                                            structured_outputs={"choice": ["xy", "z", "hello world"]})),
        "min": ([11], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4,
                                     structured_outputs={"regex": "[0-9]{1,2}"}))}
    results, texts = {}, {}
    for overlap in (True, False):
        with LLM(str(tiny_model_dirs["qwen3"]), num_kv_blocks=200, async_scheduling=overlap, **OPTIONS) as llm:
            results[overlap], pending = _run(llm.engine, requests, abort=("victim", 3))
            texts[overlap] = {rid: llm.tokenizer.decode(ids, skip_special_tokens=True) for rid, (ids, _) in results[overlap].items()}
        assert pending == (2 if overlap else 0)
    assert results[True] == results[False]
    assert results[True]["victim"] == (results[True]["victim"][0], None) and len(results[True]["victim"][0]) == 3
    assert results[True]["free"][1] == "length" and len(results[True]["free"][0]) == 25
    assert results[True]["min"][1] == "stop" and re.fullmatch("[0-9]{1,2}", texts[True]["min"])  # grammar's end
    assert results[True]["pair"][1] == "stop" and texts[True]["pair"] in ("xy", "z", "hello world")


def test_generate_under_kv_pressure_async_equals_sync(tiny_model_dirs, monkeypatch):
    """Few KV blocks: sequences are preempted with tokens in flight (async: two) and recomputed; constrained outputs
    fit, the tokens are the synchronous loop's, and every block is free at the end."""
    preempted_pending = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: preempted_pending.append(seq.num_pending) or
                        original(self, seq))
    long = [None, {"regex": "[a-c]{30,60}"}, {"regex": "[a-z ]{40,80}"}, {"choice": ["xy", "z", "hello world"]}]
    prompts = [[3 + i, 4 + i, 5 + i, 6 + i] for i in range(8)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=40, ignore_eos=True,
                             n=2 if i == 3 else 1, structured_outputs=long[i % 4]) for i in range(8)]
    runs = []
    for overlap in (True, False):
        preempted_pending.clear()
        with LLM(str(tiny_model_dirs["qwen3"]), num_kv_blocks=32, async_scheduling=overlap, **OPTIONS) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            while llm.engine.core.has_unfinished_requests():
                llm.engine.step()
            assert llm.engine.stats.preemptions > 0 and max(preempted_pending) == (2 if overlap else 0)
            bm = llm.engine.core.block_manager
            assert bm.num_free_blocks == bm.num_blocks
        runs.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs])
        for o, p in zip(outs, params):
            pattern = (p.structured_outputs.regex or "|".join(map(re.escape, p.structured_outputs.choice or [])))\
                if p.structured_outputs else None
            for c in o.outputs:
                assert pattern is None or c.finish_reason == "length" or re.fullmatch(pattern, c.text), c.text
    assert runs[0] == runs[1]
