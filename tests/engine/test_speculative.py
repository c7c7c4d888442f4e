"""Speculative decoding (issue 38) on CPU: greedy outputs identical to decoding without it under churn, preemption,
chunked prompts, prefix-cache hits, stops and penalties; sampled outputs keep the model's distribution (a chi-square
test); the verification rule on the device equals the host's; the draft plan; the configuration's errors."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.draft_plan import StepCosts, VerifyCost, choose_drafts, plan_drafts
from nanoserve.kernels.paging import kv_slots
from nanoserve.kernels.verify import store_samples_ref
from nanoserve.runner.batch import disjoint_verify_batch
from nanoserve.runner.speculative import accepted_count
from tests.engine.churn import check_blocks, run_churn

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, max_num_seqs=12)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_min_token_prob": 0.0}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}
LOOPING = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], [40, 41, 42, 43, 40, 41]]


def greedy_params(rng: random.Random, vocab: int) -> SamplingParams:
    """churn's variety without its seeded rows (speculation draws their noise in another order)."""
    common = dict(max_tokens=rng.randrange(1, 40), ignore_eos=True, temperature=0.0)
    kind = rng.choice(["plain", "stop_id", "stop_str", "min_tokens", "logprobs", "penalty"])
    extra = {"stop_id": dict(stop_token_ids=rng.sample(range(3, vocab), 40)),
             "stop_str": dict(stop=[rng.choice("aeiou"), "th"]),
             "min_tokens": dict(min_tokens=min(3, common["max_tokens"]), stop_token_ids=rng.sample(range(3, vocab), 80)),
             "logprobs": dict(logprobs=2), "penalty": dict(repetition_penalty=1.3, frequency_penalty=0.2),
             "plain": {}}[kind]
    return SamplingParams(**common, **extra)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("num_kv_blocks, chunk", [(400, 2048), (70, 2048), (400, 12)],
                         ids=["roomy", "preempting", "chunked"])
def test_greedy_equals_no_speculation_under_churn(tiny_model_dirs, method, num_kv_blocks, chunk):
    path = str(tiny_model_dirs["qwen3"])
    runs = {}
    for spec in (None, METHODS[method]):
        llm = LLM(path, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=chunk, speculative_config=spec, **OPTIONS)
        runs[spec is not None] = run_churn(llm.engine, steps=120, seed=num_kv_blocks + chunk, params=greedy_params)
    (got, stats), (want, _) = runs[True], runs[False]
    assert got == want
    assert stats.spec_method == method and stats.spec_num_drafts > 0
    assert stats.spec_accepted_tokens == sum(stats.spec_accepted_per_position) <= stats.spec_draft_tokens
    if num_kv_blocks == 70:
        assert stats.preemptions > 0


def test_indexing_while_waiting_keeps_the_tokens(tiny_model_dirs, monkeypatch):
    """The loop's waits for sampled tokens do the suffix proposer's deferred indexing (on a CPU every step is ready
    at once: here a step says it is not ready for a few checks): the tokens equal no speculation's."""
    from nanoserve.runner.sampler import SampleHandle

    path, ticks, worked = str(tiny_model_dirs["qwen3"]), itertools.count(), []
    llm = LLM(path, num_kv_blocks=400, speculative_config=SUFFIX, **OPTIONS)
    work = llm.engine.core._speculator.proposer.work
    llm.engine.core._speculator.proposer.work = lambda budget: (worked.append(budget), work(budget))[1]
    monkeypatch.setattr(SampleHandle, "ready", lambda self: next(ticks) % 4 == 3)
    got, stats = run_churn(llm.engine, steps=120, seed=7, params=greedy_params)
    monkeypatch.undo()
    want, _ = run_churn(LLM(path, num_kv_blocks=400, **OPTIONS).engine, steps=120, seed=7, params=greedy_params)
    assert got == want and worked and stats.spec_num_drafts > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_looping_prompts_accept_drafts_and_stop_exactly(tiny_model_dirs, method):
    """Drafts get accepted (the tiny Qwen3's greedy outputs fall into loops; the suffix proposer also replays a
    finished request's output); max_tokens and stop ids inside an accepted run end it exactly there, with the same
    tokens as without speculation; the counters add up."""
    path = str(tiny_model_dirs["qwen3"])
    base_llm = LLM(path, **OPTIONS)
    spec_llm = LLM(path, speculative_config=METHODS[method], **OPTIONS)
    plain = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in base_llm.generate(LOOPING, plain, use_tqdm=False)]
    got = spec_llm.generate(LOOPING, plain, use_tqdm=False)
    assert [o.token_ids for o in got] == base
    stats = spec_llm.engine.stats
    assert stats.spec_accepted_tokens > 0
    assert stats.generation_tokens == sum(len(t) for t in base)
    if method == "suffix":  # the same prompts again: their earlier outputs are drafted whole
        spec_llm.generate(LOOPING, plain, use_tqdm=False)
        again = spec_llm.engine.stats
        assert again.spec_accepted_tokens - stats.spec_accepted_tokens >= 0.8 * (
            again.spec_draft_tokens - stats.spec_draft_tokens) > 0
    assert_ends_mid_run(spec_llm, base)
    assert spec_llm.engine.core.block_manager.num_used_blocks == 0


def assert_ends_mid_run(llm, base: list[list[int]]) -> None:
    """max_tokens, then the token at `cut` as a stop id, inside accepted runs: each output ends exactly there, with
    the tokens of `base` (LOOPING's greedy outputs without speculation)."""
    for cut in (3, 7, 13):
        capped = SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(LOOPING, capped, use_tqdm=False)] == [t[:cut] for t in base]
        for prompt, want in zip(LOOPING, base):
            stop = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, stop_token_ids=[want[cut]])
            out = llm.generate(prompt, stop, use_tqdm=False)[0]
            assert out.token_ids == want[:want.index(want[cut]) + 1] and out.finish_reason == "stop"


def test_prefix_hits_windows_and_penalties_keep_tokens(tiny_model_dirs, tiny_family_dirs):
    """A prompt served again (prefix-cache hits over blocks that held rejected drafts), a windowed model, and
    penalties over the drafts' positions give the tokens decoding without speculation gives."""
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.2,
                             presence_penalty=0.3, logit_bias={7: 2.0})]
    for path in (tiny_model_dirs["qwen2"], tiny_family_dirs["mistral"]):
        outs = []
        for spec in (None, NGRAM):
            llm = LLM(str(path), speculative_config=spec, **OPTIONS)
            runs = [llm.generate(LOOPING, p, use_tqdm=False) for p in params]
            runs.append(llm.generate(LOOPING, params[0], use_tqdm=False))  # again: prefix hits
            outs.append([[o.token_ids for o in run] for run in runs])
            check_blocks(llm.engine)
        assert outs[0] == outs[1]
        assert outs[1][0] == outs[1][2]


def test_seeded_sampling_is_reproducible(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=NGRAM, **OPTIONS)
    p = SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=7, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(LOOPING, p, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(LOOPING[::-1], p, use_tqdm=False)] == first[::-1]


def _chi_square_p(a: dict, b: dict) -> float:
    """Two-sample chi-square test of homogeneity over the outcomes' union: the p-value."""
    keys = sorted(set(a) | set(b), key=repr)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a.get(k, 0) + b.get(k, 0)
        for count, n in ((a.get(k, 0), na), (b.get(k, 0), nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    df = len(keys) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_outputs_keep_the_distribution(tiny_model_dirs):
    """Temperature 1 over each position's 3 likeliest tokens: the joint law of the first four tokens is the same with
    drafts verified. The requests run in waves, so the suffix proposer drafts the later waves from the earlier waves'
    outputs: likely continuations, accepted often and rejected often."""
    path, waves, per_wave = str(tiny_model_dirs["llama"]), 6, 300
    p = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    spec = {**SUFFIX, "suffix_decoding_max_spec_factor": 4.0, "adaptive": False}
    counts = []
    for setting in (None, spec):
        llm = LLM(path, speculative_config=setting, enable_prefix_caching=False, **{**OPTIONS, "max_num_seqs": 64})
        seen: dict = {}
        for _ in range(waves):
            for o in llm.generate([LOOPING[0]] * per_wave, p, use_tqdm=False):
                seen[tuple(o.token_ids)] = seen.get(tuple(o.token_ids), 0) + 1
        counts.append(seen)
        if setting is not None:
            stats = llm.engine.stats
            assert stats.spec_draft_tokens > waves * per_wave
            assert 0.2 * stats.spec_draft_tokens < stats.spec_accepted_tokens < 0.9 * stats.spec_draft_tokens
    assert len(counts[0]) > 10
    assert _chi_square_p(*_pooled(counts)) > 1e-3


def _pooled(counts: list[dict], least: int = 10) -> list[dict]:
    """Outcomes seen fewer than `least` times in both samples pooled into one (the chi-square approximation)."""
    rare = {k for k in set(counts[0]) | set(counts[1]) if counts[0].get(k, 0) + counts[1].get(k, 0) < least}
    out = []
    for c in counts:
        pooled = {k: v for k, v in c.items() if k not in rare}
        pooled[("rare",)] = sum(v for k, v in c.items() if k in rare)
        out.append(pooled)
    return out


def test_device_rule_equals_host_rule():
    """store_samples ends each sequence's accepted run exactly at the row accepted_count gives (its token becomes the
    slot's last one) and records the rows up to it in the slot's history."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        drafts = [torch.randint(0, 3, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(int(torch.randint(1, 6, (1,), generator=gen)))]
        samples = [torch.randint(0, 3, (len(d) + 1,), generator=gen).tolist() for d in drafts]
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        slots = i32([i for i, d in enumerate(drafts) for _ in range(len(d) + 1)])
        positions = i32([10 + j for d in drafts for j in range(len(d) + 1)])
        last, history, hist_len = torch.full((8,), -5, dtype=torch.int32), torch.full((8, 20), -5, dtype=torch.int32), \
            torch.zeros(8, dtype=torch.int32)
        store_samples_ref(i32([x for s in samples for x in s]), slots, last, i32([x for d in drafts for x in [*d, -1]]),
                          i32([j for d in drafts for j in range(len(d) + 1)]), positions, history, hist_len)
        for i, (d, s) in enumerate(zip(drafts, samples)):
            a = accepted_count(s, d)
            assert last[i] == s[a] and hist_len[i] == 10 + a + 2
            assert history[i, 11:12 + a].tolist() == s[:a + 1] and (history[i, 12 + a:] == -5).all()


def test_plan_drafts_follows_the_costs():
    flat = lambda rows: 1.0 + 0.0 * rows  # noqa: E731 (a verification costs what a decode step does)
    steep = lambda tokens: 1.0 + 0.5 * (tokens - 1)  # noqa: E731
    assert plan_drafts([4, 4], [0.9, 0.9], flat, flat) == [4, 4]
    assert plan_drafts([4, 4], [0.9, 0.05], flat, lambda t: 1.0 + 0.05 * t) == [4, 0]
    assert plan_drafts([4], [0.5], flat, steep) == [0]
    assert plan_drafts([0, 3], [0.9, 0.9], flat, flat) == [0, 3]
    assert plan_drafts([], [], flat, flat) == []


def test_single_stream_plan_equals_the_rule():
    """b = 1 takes a plain-Python path (numpy's set-up cost more than the arithmetic): the rule's choice, the n with
    the most expected tokens (1 + Σ_j≤n w·α^j) per ms, over random rates, prices, host times and weights."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        length, rate, weight = int(rng.integers(1, 9)), float(rng.uniform(0.0, 1.0)), float(rng.uniform(0.05, 1.0))
        slope, host = float(rng.uniform(0.0, 0.4)), [None, float(rng.uniform(0.0, 2.0))][int(rng.integers(2))]
        costs = StepCosts(lambda r, s=slope: 1.0 + s * (np.asarray(r) - 1.0) ** 1.2, lambda t: 0.5 + 0.3 * np.asarray(t),
                          max_decode_rows=int(rng.integers(1, 10)))
        priced = np.array(costs(1, length))
        if host is not None:
            priced[0], priced[1:] = max(priced[0], host), priced[1:] + host
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(weight * rate ** np.arange(1, length + 1))])
        want = int(np.argmax(expected / priced))
        assert choose_drafts([length], [rate], costs(1, length), host, [weight]) == [want]
        assert plan_drafts([length], [rate], costs.decode_ms, costs.tokens_ms, costs.max_decode_rows, None, host,
                           [weight]) == [want]


def test_step_costs_are_kept_per_batch_and_drafts():
    calls = []
    flat = lambda rows: (calls.append(1), 1.0 + 0.0 * np.asarray(rows))[1]  # noqa: E731
    costs = StepCosts(flat, flat, max_decode_rows=8)
    first = costs(2, 6)
    assert costs(2, 6) is first and not first.flags.writeable and len(first) == 7
    made = len(calls)
    costs(2, 6)
    assert len(calls) == made  # looked up, not priced again
    assert costs(3, 6) is not first
    assert choose_drafts([4, 2], [0.9, 0.9], first, host_ms=0.5) == plan_drafts([4, 2], [0.9, 0.9], flat, flat, 8,
                                                                             host_ms=0.5)
    assert first[0] == 1.0  # host_ms priced on a copy


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle"}', "method must be one of"), ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "suffix", "prompt_lookup_max": 2}, "do not apply"), ("{", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key")])
def test_config_errors_are_one_line(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=value)


def test_config_fills_defaults():
    cfg = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
                                      "prompt_lookup_max": 5, "adaptive": True}
    assert cfg.max_sampled_rows == 4 * cfg.max_num_seqs


def test_verification_through_token_graph_inputs(tiny_model_dirs):
    """Verification steps through the token-count graphs' static inputs (their eager twin on CPU) give the tokens
    decoding without speculation gives (suffix drafts: host drafts verify beside prompts; device drafts never do)."""
    path, sizes = str(tiny_model_dirs["qwen3"]), [4, 8, 12, 16, 24, 32, 48, 64]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in LLM(path, **OPTIONS).generate(LOOPING, params, use_tqdm=False)]
    llm = LLM(path, speculative_config=SUFFIX, prefill_graph_sizes=sizes, max_num_batched_tokens=64, **OPTIONS)
    assert [o.token_ids for o in llm.generate(LOOPING, params, use_tqdm=False)] == base
    stats = llm.engine.stats
    assert stats.prefill_steps_graph > 0 and stats.prefill_steps_eager == 0 and stats.spec_accepted_tokens > 0


def test_metrics_carry_the_acceptance_counters():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from nanoserve.engine.messages import EngineStats
    from nanoserve.server.metrics import ServerMetrics

    stats = EngineStats(spec_method="ngram", spec_num_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=6,
                        spec_accepted_per_position=[4, 2, 0])
    text = generate_latest(ServerMetrics(SimpleNamespace(stats=stats)).registry).decode()
    assert 'nanoserve_spec_decode_num_draft_tokens_total{method="ngram"} 12.0' in text
    assert 'nanoserve_spec_decode_num_accepted_tokens_total{method="ngram"} 6.0' in text
    assert 'nanoserve_spec_decode_num_accepted_tokens_per_pos_total{method="ngram",position="1"} 2.0' in text
    assert "nanoserve_spec_decode_mean_accepted_length 2.5" in text
    plain = generate_latest(ServerMetrics(SimpleNamespace(stats=EngineStats())).registry).decode()
    assert "spec_decode" not in plain


def test_a_stop_string_inside_a_multi_token_delta_drops_what_follows(tiny_model_dirs):
    """A delta of verified drafts is read token by token: the stop string ends the completion at its token."""
    from nanoserve.engine.messages import SeqOutput
    from nanoserve.engine.output import _Completion
    from nanoserve.model_files import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dirs["qwen3"]))
    ids = tok.encode("hello world, stop here please", add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if "stop" in tok.decode(ids[:i + 1]))
    params = SamplingParams(stop=["stop"], logprobs=0)
    c = _Completion(0, [1, 2], params, tok, incremental=True)
    assert c.append(SeqOutput("r", ids, token_logprobs=[-0.5] * len(ids), top_logprobs=[[] for _ in ids]))
    assert c.token_ids == ids[:stop_at + 1] and len(c.logprobs) == stop_at + 1
    assert c.cumulative_logprob == pytest.approx(-0.5 * (stop_at + 1))
    assert c.text == tok.decode(ids[:stop_at + 1]).split("stop")[0] and c.finish_reason == "stop"


def test_plan_drafts_costs_decode_rows_up_to_the_largest_decode_batch():
    steep = lambda rows: 1.0 + 0.5 * (rows - 1)  # noqa: E731
    flat = lambda tokens: 1.0 + 0.0 * tokens  # noqa: E731
    assert plan_drafts([4], [0.5], steep, flat, max_decode_rows=1) == [4]  # verified as a (flat) token step
    assert plan_drafts([4], [0.5], steep, flat, max_decode_rows=8) == [0]  # as (steep) decode rows


def test_verify_cost_lies_between_rows_apart_and_grouped():
    """A verification's rows cost by its sequences: all of them apart (one row each) at the apart curve, in full
    groups at the grouped curve, between them linearly; so grouped rows make drafts pay at mid batches."""
    apart = lambda rows: 1.0 + 0.3 * rows  # noqa: E731 (every row its own context)
    grouped = lambda rows: 1.0 + 0.02 * rows  # noqa: E731 (a sequence's rows read its context once)
    cost = VerifyCost(apart, grouped, group=5)
    assert cost(np.array([10.0]), 10)[0] == pytest.approx(4.0)  # 10 sequences of one row: apart
    assert cost(np.array([10.0]), 2)[0] == pytest.approx(1.2)  # 2 sequences of 5: grouped
    assert cost(np.array([10.0]), 6)[0] == pytest.approx(2.6)  # half way
    assert cost(np.array([1.0]), 1)[0] == pytest.approx(1.02)
    assert VerifyCost(apart)(np.array([10.0]), 2)[0] == pytest.approx(4.0)  # no grouped curve: apart
    # 8 sequences offered 4 drafts each at acceptance 0.5: as plain rows (0.3 ms each) none pays, grouped some do
    flat = lambda tokens: 100.0 + 0.0 * tokens  # noqa: E731 (token-count steps: never chosen)
    assert plan_drafts([4] * 8, [0.5] * 8, apart, flat, max_decode_rows=64) == [0] * 8
    assert sum(plan_drafts([4] * 8, [0.5] * 8, apart, flat, max_decode_rows=64, verify=cost)) > 0


def test_disjoint_verify_batch_groups_rows_by_sequence():
    """The start-up's verification probe: runs of `group` rows share a slot, positions climb to the last row's
    context, the first row runs the slot's last token and every other row a draft checked by the row before."""
    batch, tables = disjoint_verify_batch(7, 3, 10, 4, 64)
    assert batch.slots.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert batch.group_back.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert batch.positions.tolist() == [7, 8, 9, 7, 8, 9, 9]
    assert batch.context_lens.tolist() == [8, 9, 10, 8, 9, 10, 10]
    assert batch.token_ids.tolist() == [-1, 0, 0, -1, 0, 0, -1]
    assert batch.draft_ids.tolist() == [0, 0, -1, 0, 0, -1, -1]
    assert tables.shape == (3, 3) and len(set(tables.ravel().tolist())) == 9  # disjoint blocks
    assert batch.slot_mapping.tolist() == kv_slots(tables[batch.slots].tolist(), batch.positions, 4).tolist()
    assert batch.slot_mapping[2] == tables[0, 2] * 4 + 1


def test_plan_drafts_prices_the_hosts_wait_and_the_chance_of_a_draft():
    """Host drafts make the loop wait for the host: a plain step costs max(device, host), a verifying one both; a
    draft counts by the chance one is found at all."""
    flat = lambda rows: 1.0 + 0.0 * rows  # noqa: E731
    assert plan_drafts([4], [0.3], flat, flat, max_decode_rows=8) == [4]
    assert plan_drafts([4], [0.3], flat, flat, max_decode_rows=8, host_ms=0.8) == [0]  # 1.4 tokens for 1.8 ms vs 1 for 1
    assert plan_drafts([4], [0.9], flat, flat, max_decode_rows=8, host_ms=0.8) == [4]  # 4.1 tokens for 1.8 ms
    assert plan_drafts([4], [0.9], flat, flat, max_decode_rows=8, host_ms=0.8, weights=[0.1]) == [0]
    assert plan_drafts([4], [0.3], flat, flat, max_decode_rows=8, host_ms=3.0) == [4]  # host-bound: waiting is cheap


def _drive_watched(llm, prompts, params, steps_before=None) -> tuple[list, int]:
    """Run prompts by engine steps: (token ids per prompt, steps scheduled while another was in flight);
    steps_before(i): called before step i."""
    core, tokens, overlapped, i = llm.engine.core, {}, [], 0
    schedule = core.scheduler.schedule

    def watched():
        overlapped.append(len(core._pipeline) > 0)
        return schedule()

    core.scheduler.schedule = watched
    for n, p in enumerate(prompts):
        llm.engine.add_request(str(n), p, params)
    while core.has_unfinished_requests():
        if steps_before is not None:
            steps_before(i)
        i += 1
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[k] for k in sorted(tokens)], sum(overlapped)


def _pin_host_ms(spec, host_ms: float) -> None:
    worth_waiting = spec.worth_waiting
    spec.worth_waiting = lambda running, _measured, host=False: worth_waiting(running, host_ms, host)


def test_host_drafts_back_off_when_waiting_does_not_pay(tiny_model_dirs):
    """With step curves that make verification dear (as measured CUDA graphs would say), suffix speculation backs
    off: the loop runs asynchronously, nothing is verified, and each sequence's acceptance is still measured against
    shadow drafts; made cheap again, drafting resumes. The tokens are those without speculation throughout. (The
    host's time a step is pinned: the measured one varies from machine to machine, and so would the plan.)"""
    path = str(tiny_model_dirs["qwen3"])
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in LLM(path, **OPTIONS).generate(LOOPING, params, use_tqdm=False)]
    dear = lambda rows: 1.0 + 100.0 * (rows - 1)  # noqa: E731
    flat = lambda rows: 1.0 + 0.0 * rows  # noqa: E731
    llm = LLM(path, speculative_config=SUFFIX, **OPTIONS)
    spec = llm.engine.core._speculator
    spec._costs = StepCosts(dear, dear, spec.max_decode_rows)
    _pin_host_ms(spec, 0.01)
    tokens, overlapped = _drive_watched(llm, LOOPING, params)
    assert tokens == base and overlapped > 0
    stats = llm.engine.stats
    assert stats.spec_draft_tokens == 0 and spec.backed_off

    def cheapen(i):
        if i == 12:
            spec._costs = StepCosts(flat, flat, spec.max_decode_rows)
    llm2 = LLM(path, speculative_config=SUFFIX, **OPTIONS)
    spec = llm2.engine.core._speculator
    spec._costs = StepCosts(dear, dear, spec.max_decode_rows)
    _pin_host_ms(spec, 0.01)
    shadowed = []
    original = spec._check_shadow
    spec._check_shadow = lambda seq, toks: (shadowed.append(seq.request_id), original(seq, toks))
    tokens, _ = _drive_watched(llm2, LOOPING, params, cheapen)
    assert tokens == base
    assert shadowed and llm2.engine.stats.spec_accepted_tokens > 0  # measured while backed off, then drafted


@pytest.mark.parametrize("num_seqs", [1, 8, 24])
def test_backed_off_shadow_drafts_are_spread_over_steps(num_seqs):
    """Backed off, at most SHADOW_DRAFTS_PER_STEP sequences get a shadow draft a step, each in turn and at most once
    every BACKED_OFF_TURNS steps, and a shadow draft settles like a verified one (drafted, accepted) once its tokens
    arrive."""
    from nanoserve.engine.sequence import Sequence
    from nanoserve.engine.speculation import Speculator
    from nanoserve.speculative_config import BACKED_OFF_TURNS, SHADOW_DRAFTS_PER_STEP, SpeculativeConfig

    dear = lambda rows: 1.0 + 100.0 * (rows - 1)  # noqa: E731
    spec = Speculator(SpeculativeConfig.parse(SUFFIX), 128, 12, dear, dear)
    seqs = [Sequence(str(i), [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=50)) for i in range(num_seqs)]
    for slot, seq in enumerate(seqs):
        seq.slot, seq.decoding = slot, True
        spec.add(seq)
    every = max(-(-num_seqs // SHADOW_DRAFTS_PER_STEP), BACKED_OFF_TURNS)
    proposed, turns = set(), {}
    for step in range(every):
        assert not spec.worth_waiting(seqs, 0.01) and spec.backed_off
        before = set(spec._shadow)
        for seq in seqs:
            spec.extend(seq, [7])  # (the loop's next token: a pending shadow draft of 5, 6, 7, ... matches on)
        spec.idle(lambda: False)  # (the loop waits for the device: the shadow drafts due are proposed)
        new = set(spec._shadow) - before
        assert len(new) <= SHADOW_DRAFTS_PER_STEP and not new & proposed
        proposed |= new
    assert proposed == {s.request_id for s in seqs}  # every sequence had its turn, once
    seq = seqs[0]
    drafts = list(spec._shadow[seq.request_id][0])
    spec.backed_off = False  # (no new shadow after it settles)
    spec.extend(seq, [drafts[0], -1])  # one match, then a miss (or the draft's end): settled
    assert seq.request_id not in spec._shadow and seq.num_accepted >= 1 and seq.num_drafted >= len(drafts)


def test_plan_cut_drafts_are_shadowed_so_a_fallen_rate_recovers(monkeypatch):
    """A sequence whose acceptance rate fell gets no drafts from the plan; its proposer's drafts are then kept as a
    shadow draft that the following tokens settle, so once the text repeats its rate climbs and the plan drafts for
    it again. Without the shadow its rate would stay where it fell, and it would never draft again."""
    from nanoserve.engine.sequence import Sequence
    from nanoserve.engine.speculation import Speculator
    from nanoserve.speculative_config import SpeculativeConfig

    price = lambda rows: 1.0 + 0.3 * (np.asarray(rows) - 1)  # noqa: E731

    def offers(shadow: bool) -> tuple[list[int], int]:
        spec = Speculator(SpeculativeConfig.parse(NGRAM), 256, 12, price, price)
        if not shadow:
            monkeypatch.setattr(spec, "_shadow_cut", lambda *a: None)
        seq = Sequence("0", [5, 6, 7, 8] * 3, SamplingParams(max_tokens=100))
        seq.slot, seq.decoding = 0, True
        seq.num_drafted = 16  # (every draft so far rejected: rate 1/18)
        spec.add(seq)
        counts = []
        for token in [5, 6, 7, 8] * 4:  # (the text repeats: what the proposer drafts comes)
            spec.offer([seq], on_device=True)
            counts.append(len(seq.draft_token_ids))
            seq.output_token_ids.append(token)
            spec.extend(seq, [token])
        return counts, seq.num_accepted

    (counts, accepted), (unshadowed, _) = offers(True), offers(False)
    assert counts[0] == 0 and counts[-1] > 0 and accepted > 0
    assert not any(unshadowed)


def test_device_drafts_found_none_weigh_the_plan_not_the_acceptance_rate(monkeypatch):
    """A device-drafted verification whose device found none of the drafts the host offered (the host's older
    tokens matched, the newest did not) is no rejection: the sequence's acceptance rate counts the drafts found, and
    the chance that the device finds them weighs the plan of the asynchronous loop (a draft's worth) instead."""
    import nanoserve.engine.speculation as speculation
    from nanoserve.engine.draft_plan import found_rate
    from nanoserve.engine.sequence import Sequence
    from nanoserve.speculative_config import SpeculativeConfig

    price = lambda rows: 1.0 + 0.3 * (np.asarray(rows) - 1)  # noqa: E731
    spec = speculation.Speculator(SpeculativeConfig.parse(NGRAM), 256, 12, price, price)
    seq = Sequence("0", [5, 6, 7, 8] * 3, SamplingParams(max_tokens=100))
    seq.slot, seq.decoding = 0, True
    spec.add(seq)
    assert spec.verified(seq, [-1, -1, -1], [9, 4, 4, 4]) == [9]  # (found none: the sample after them is kept)
    assert (seq.num_drafted, seq.num_accepted, spec._landed["0"]) == (0, 0, [0, 1])
    assert spec.verified(seq, [5, 6, -1], [5, 6, 7, 4]) == [5, 6, 7]  # (found two, both accepted)
    assert (seq.num_drafted, seq.num_accepted, spec._landed["0"]) == (2, 2, [1, 2])
    assert spec.draft_tokens == 2 and spec.accepted_tokens == 2
    weights = []
    choose = speculation.choose_drafts
    monkeypatch.setattr(speculation, "choose_drafts", lambda *a, **k: (weights.append(k["weights"]), choose(*a))[1])
    for on_device in (True, False):  # (the host's own drafts, scheduled once every token is known, always land)
        spec.offer([seq], on_device=on_device)
    assert weights == [[found_rate(1, 2)], None] and len(seq.draft_token_ids) > 0
    spec.remove(seq, keep_outputs=False)
    assert "0" not in spec._landed


def test_backed_off_plan_is_priced_again_only_now_and_then(monkeypatch):
    """Backed off, the plan is priced again every BACKED_OFF_TURNS steps, or at the next step after a shadow draft
    settled or a sequence came; made cheap, drafting resumes within BACKED_OFF_TURNS steps."""
    import nanoserve.engine.speculation as speculation
    from nanoserve.engine.sequence import Sequence
    from nanoserve.speculative_config import BACKED_OFF_TURNS, SpeculativeConfig

    dear = lambda rows: 1.0 + 100.0 * (np.asarray(rows) - 1)  # noqa: E731
    spec = speculation.Speculator(SpeculativeConfig.parse(SUFFIX), 128, 12, dear, dear)
    priced = []
    choose = speculation.choose_drafts
    monkeypatch.setattr(speculation, "choose_drafts", lambda *a: (priced.append(1), choose(*a))[1])
    seq = Sequence("0", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=100))
    seq.slot, seq.decoding = 0, True
    spec.add(seq)
    steps, settled = 6 * BACKED_OFF_TURNS, 0
    for _ in range(steps):
        assert not spec.worth_waiting([seq], 0.01)
        spec.idle(lambda: False)
        shadowed = "0" in spec._shadow
        spec.extend(seq, [9])  # (never what a shadow draft predicts: each one settles at its first token)
        settled += shadowed and "0" not in spec._shadow
    assert settled and len(priced) <= 1 + steps // BACKED_OFF_TURNS + settled < steps
    spec._costs = StepCosts(lambda r: 1.0 + 0.0 * np.asarray(r), lambda r: 1.0 + 0.0 * np.asarray(r), 12)
    assert any(spec.worth_waiting([seq], 0.01) for _ in range(BACKED_OFF_TURNS))


def test_shadow_drafts_are_the_same_made_while_waiting_or_not():
    """Backed off, a shadow draft due is proposed while the loop waits for the device (idle), or else before the
    sequence's next tokens: from the same tokens either way, so the acceptance measured is the same."""
    from nanoserve.engine.sequence import Sequence
    from nanoserve.engine.speculation import Speculator
    from nanoserve.speculative_config import SpeculativeConfig

    dear = lambda rows: 1.0 + 100.0 * (np.asarray(rows) - 1)  # noqa: E731
    stream = [5, 6, 7, 8] * 12
    counts = []
    for waits in (False, True):
        spec = Speculator(SpeculativeConfig.parse(SUFFIX), 256, 12, dear, dear)
        seq = Sequence("0", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=100))
        seq.slot, seq.decoding = 0, True
        spec.add(seq)
        for token in stream:
            assert not spec.worth_waiting([seq], 0.01)
            if waits:
                spec.idle(lambda: False)
            seq.output_token_ids.append(token)
            spec.extend(seq, [token])
        counts.append((seq.num_drafted, seq.num_accepted, spec._found["0"]))
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_idle_indexes_what_waits_until_the_step_is_ready():
    """While the loop waits for the device, the suffix proposer indexes deferred tokens (the live request's first,
    then an ended one's outputs into the global trie), IDLE_INDEX_TOKENS at a time, stopping once the step is
    ready; drafts are the same as without it."""
    from nanoserve.engine.sequence import Sequence
    from nanoserve.engine.speculation import Speculator
    from nanoserve.speculative_config import IDLE_INDEX_TOKENS, SpeculativeConfig

    def run(idle_checks: int | None):
        spec = Speculator(SpeculativeConfig.parse(SUFFIX), 256, 12)
        ended = Sequence("ended", [1, 2], SamplingParams(max_tokens=50))
        spec.add(ended)
        spec.extend(ended, [3, 4, 5, 6, 7, 8, 9, 10])
        spec.remove(ended, keep_outputs=True)
        seq = Sequence("0", [3, 4, 5, 11, 3, 4], SamplingParams(max_tokens=50))
        seq.slot, seq.decoding = 0, True
        spec.add(seq)
        proposer, checks = spec.proposer, []
        if idle_checks is not None:
            spec.idle(lambda: len(checks) >= idle_checks or checks.append(1))
        waiting = len(seq.prompt_token_ids) - proposer._requests["0"].num_indexed, len(proposer._arriving)
        return proposer.propose("0", 8), len(checks), *waiting

    drafts, _, waiting, arriving = run(None)
    assert drafts == [5, 6] and waiting == 6 and arriving == 1  # (the ended request's "3 4 5 6" drafts)
    assert run(0)[1:] == (0, 6, 1)  # ready at once: nothing indexed
    assert run(1)[1:] == (1, 6 - IDLE_INDEX_TOKENS, 1)  # one chunk of the live request's tokens
    assert run(100) == (drafts, 4, 0, 0)  # everything (6 + 8 tokens), then it stops asking: nothing waits


def test_decode_rows_of_one_sequence_are_bounded(tiny_model_dirs):
    """The decode graphs read a sequence's rows as one attention group of at most 1 + num_speculative_tokens rows
    (AttentionMetadata.seq_rows): a batch with more is refused in one line, not read wrong."""
    from nanoserve.bench.decode_step import verify_batch

    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=NGRAM, **OPTIONS)
    runner = llm.engine.core.runner
    fwd = runner.buffers.decode_forward
    assert fwd.seq_rows == 1 + NGRAM["num_speculative_tokens"]
    fwd.load(verify_batch(runner, 2, 20, 4), 10)  # k + 1 rows each: fine
    with pytest.raises(ValueError, match="runs 6 rows of one sequence; this runner's graphs take at most 5"):
        fwd.load(verify_batch(runner, 1, 20, 5), 6)
    llm.close()


def test_verification_probe_runs_through_the_decode_forward(tiny_model_dirs):
    """Probes.load_verify (the start-up's verification curve, timed over the graphs on CUDA) loads rows grouped by
    sequence within the runner's bound (1 + num_speculative_tokens rows), and the decode forward runs them."""
    from nanoserve.runner.startup.probes import Probes

    llm = LLM(str(tiny_model_dirs["llama"]), speculative_config=NGRAM, **OPTIONS)
    runner = llm.engine.core.runner
    probes = Probes(runner.buffers, runner.config, runner.kv, runner.info.num_kv_blocks, runner.info.vocab_size,
                    runner.rng, torch.Generator().manual_seed(1))
    fwd, group = runner.buffers.decode_forward, 1 + NGRAM["num_speculative_tokens"]
    probes.load_verify(12)
    views = fwd.inputs.views(12)
    assert views.group_back.tolist() == [j % group for j in range(12)]
    assert views.slots.tolist() == [j // group for j in range(12)]
    logits = fwd(12, runner.kv.blocks_for(int(views.context_lens.max()))).float()
    assert logits.shape[0] == 12 and torch.isfinite(logits).all()
