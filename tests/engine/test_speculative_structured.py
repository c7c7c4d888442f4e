"""Speculative decoding beside structured outputs (issue 38, item 3): a constrained sequence verifies host drafts its
grammar accepts, each verified row under the mask of its own position (its matcher advanced by the drafts before it,
then rolled back), and its matcher advances by the run the verification kept; unconstrained sequences beside it keep
drafting. Greedy tokens equal decoding without speculation, in the asynchronous and the synchronous loop; sampled
constrained output still fits its grammar (CPU, the tiny Qwen3 and its tokenizer)."""
from __future__ import annotations

import re

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.speculation import Speculator
from nanoserve.sampling import StructuredOutputsParams as Constraint
from tests.engine.test_speculative import NGRAM

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8, num_kv_blocks=64,
               show_progress=False)
PROMPTS = ["a", "b b b b", "c"]
GREEDY = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"regex": "(xyz|xy)+w"}),  # loops
          SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": "(ab)+"})]


def _run(path: str, prompts, params, **options) -> tuple[list, dict]:
    """Token ids per prompt, and per request id how many drafts its verified rows checked."""
    drafted: dict[str, int] = {}
    original = Speculator.verified

    def verified(self, seq, drafts, samples):
        drafted[seq.request_id] = drafted.get(seq.request_id, 0) + len(drafts)
        return original(self, seq, drafts, samples)

    Speculator.verified = verified
    try:
        with LLM(path, **OPTIONS, **options) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            accepted = llm.engine.stats.spec_accepted_tokens if "speculative_config" in options else 0
    finally:
        Speculator.verified = original
    return [o.outputs[0].token_ids for o in outs], {"accepted": accepted, **drafted}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_greedy_equals_no_speculation(tiny_model_dirs, async_scheduling):
    path = str(tiny_model_dirs["qwen3"])
    want, _ = _run(path, PROMPTS, GREEDY, async_scheduling=async_scheduling)
    got, drafted = _run(path, PROMPTS, GREEDY, speculative_config=NGRAM, async_scheduling=async_scheduling)
    assert got == want
    assert drafted["accepted"] > 0
    assert drafted.get("gen-0/0", 0) > 0 and drafted.get("gen-1/0", 0) > 0  # a constrained one, the free one beside


def test_sampled_constrained_output_fits_its_grammar(tiny_model_dirs):
    params = [SamplingParams(temperature=1.0, max_tokens=40, structured_outputs={"regex": "(ab|c)+d"}),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs={"choice": ["xy", "xyz"]}),
              SamplingParams(temperature=0.7, max_tokens=30, structured_outputs={"regex": "[a-c]{5,30}"}),
              SamplingParams(temperature=0.0, max_tokens=6, presence_penalty=0.5)]  # the loop waits a while
    with LLM(str(tiny_model_dirs["qwen3"]), speculative_config=NGRAM, **OPTIONS) as llm:
        for _ in range(3):
            outs = llm.generate(PROMPTS + ["d"], params, use_tqdm=False)
            texts = [o.outputs[0] for o in outs]
            assert re.fullmatch("(ab|c)+d", texts[0].text) or texts[0].finish_reason == "length"
            assert texts[1].text in ("xy", "xyz") and re.fullmatch("[a-c]{5,30}", texts[2].text)
        assert llm.engine.stats.spec_accepted_tokens > 0


def test_a_draft_model_drafts_nothing_beside_constrained_sequences(drafts):
    """A draft model's drafts exist only on the device, where no mask can follow them: while a constrained sequence
    runs nobody drafts (the tokens stay those of decoding without speculation)."""
    want, _ = _run(drafts["target"], PROMPTS, GREEDY)
    got, drafted = _run(drafts["target"], PROMPTS, GREEDY,
                        speculative_config={"method": "draft_model", "model": drafts["self"],
                                            "num_speculative_tokens": 3})
    assert got == want


@pytest.fixture(scope="module")
def grammar(tiny_model_dirs):
    """The engine's Grammars for the tiny tokenizer, a compiled "(ab)+" and the ids of "a", "b", "c"."""
    with LLM(str(tiny_model_dirs["qwen3"]), **OPTIONS) as llm:
        store = llm.engine.core._grammar_store()
        compiled = store.compile(Constraint(regex="(ab)+")).result()
        ids = [llm.tokenizer.convert_tokens_to_ids(t) for t in "abc"]
        yield store, compiled, ids


class _Seq:
    def __init__(self, matcher, drafts):
        self.grammar, self.draft_token_ids = matcher, drafts


def _mask(store, matcher) -> torch.Tensor:
    matcher.fill_next_token_bitmask(store._bitmask, 0)
    return store._bitmask[0].clone()


def test_trim_keeps_what_the_grammar_accepts_and_rolls_back(grammar):
    store, compiled, (a, b, c) = grammar
    matcher = store.matcher(compiled)
    assert matcher.accept_token(a)
    before = _mask(store, matcher)
    seq = _Seq(matcher, [b, a, b, b, a])
    store.trim_drafts([seq])
    assert seq.draft_token_ids == [b, a, b]  # cut at the second b in a row
    assert torch.equal(_mask(store, matcher), before)  # rolled back to after "a"
    seq = _Seq(matcher, [c, b])
    store.trim_drafts([seq])
    assert seq.draft_token_ids == []


def test_a_verifications_rows_are_masked_at_their_own_positions(grammar):
    """Row j of an entry is masked as its matcher stands after its first j drafts; rows without a matcher allow
    everything; the matchers end where they began."""
    store, compiled, (a, b, _c) = grammar
    matcher, fresh = store.matcher(compiled), store.matcher(compiled)
    expected = []
    for token in (a, b, a):
        expected.append(_mask(store, fresh))
        assert fresh.accept_token(token)
    expected.append(_mask(store, fresh))
    start = _mask(store, matcher)
    fill = store.start_fill([None, matcher], [[7, 8], [a, b, a]])
    rows, bitmask = fill.result()
    assert rows.tolist() == [3, 4, 5, 6] and bitmask.shape[0] == 7
    assert (bitmask[:3] == -1).all()
    for j in range(4):
        assert torch.equal(bitmask[3 + j], expected[j])
    assert torch.equal(_mask(store, matcher), start)


def test_prompts_arriving_beside_constrained_verifications(tiny_model_dirs):
    """Requests added while constrained sequences verify drafts: the mixed steps' rows (a prompt's, and each verifying
    sequence's drafts) keep their masks in order; every sequence's tokens equal decoding without speculation."""
    from nanoserve.engine.messages import EngineRequest

    path = str(tiny_model_dirs["qwen3"])
    prompts, params = PROMPTS * 2, GREEDY * 2
    want, _ = _run(path, prompts, params)
    with LLM(path, speculative_config=NGRAM, **OPTIONS) as llm:
        core, tokens = llm.engine.core, {}
        ids = [llm.tokenizer.encode(p) for p in prompts]
        for i in range(3):
            core.add_request(EngineRequest(str(i), ids[i], params[i]))
        steps = 0
        while core.has_unfinished_requests() or steps < 6:
            steps += 1
            if steps in (4, 6, 8):  # one more each time, while the others verify
                i = 3 + (steps - 4) // 2
                core.add_request(EngineRequest(str(i), ids[i], params[i]))
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert core._mixed_steps > 3 and llm.engine.stats.spec_accepted_tokens > 0
    assert [tokens[str(i)] for i in range(6)] == want


def _constrained_churn_params(rng, vocab: int) -> SamplingParams:
    """The speculation churn's greedy variety, and as often a constrained request (min_tokens with one of them)."""
    from tests.engine.test_speculative import greedy_params

    kind = rng.choice(["free", "loop", "choice", "letters", "long_choice"])
    if kind == "free":
        return greedy_params(rng, vocab)
    common = dict(max_tokens=rng.randrange(13, 40), temperature=0.0)
    constraint = {"loop": {"regex": "(xyz|xy)+w"}, "choice": {"choice": ["xy", "xyz", "z"]},
                  "letters": {"regex": "[a-c]{5,30}"}, "long_choice": {"choice": ["xyxyxyxy"]}}[kind]
    return SamplingParams(**common, structured_outputs=constraint, min_tokens=4 if kind == "long_choice" else 0)


@pytest.mark.parametrize("num_kv_blocks, chunk", [(400, 2048), (70, 12)], ids=["roomy", "preempting-chunked"])
def test_constrained_churn_equals_no_speculation(tiny_model_dirs, num_kv_blocks, chunk):
    from tests.engine.churn import run_churn

    runs = {}
    for spec in (None, NGRAM):
        with LLM(str(tiny_model_dirs["qwen3"]), **{**OPTIONS, "num_kv_blocks": num_kv_blocks},
                 max_num_batched_tokens=chunk, speculative_config=spec) as llm:
            runs[spec is not None] = run_churn(llm.engine, steps=100, seed=num_kv_blocks + chunk,
                                               params=_constrained_churn_params)
    (got, stats), (want, _) = runs[True], runs[False]
    assert got == want
    assert stats.spec_num_drafts > 0
