"""Structured outputs in the engine (xgrammar): the real SmolLM2-135M GGUF writes JSON that validates against a nested
schema, regexes and choices it must fit; masking changes nothing the grammar allows (greedy constrained == greedy
unconstrained, logprobs over the allowed tokens only); the async loop gives the same tokens as the synchronous one;
seeds, n > 1, streaming, min_tokens and bad grammars (a ValueError before anything runs) behave (CPU)."""
from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.messages import EngineRequest
from nanoserve.sampling import StructuredOutputsParams as Constraint

SCHEMA = {  # nested objects, an array with bounds, enums, a nullable field
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "zip": {"type": ["string", "null"], "maxLength": 8}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "address", "colors"], "additionalProperties": False}


def check_person(text: str) -> None:
    """The schema, checked by hand (jsonschema is not a dependency)."""
    p = json.loads(text)
    assert list(p) == ["name", "age", "address", "colors"], text  # the schema's order
    assert isinstance(p["name"], str) and len(p["name"]) <= 20, text
    assert isinstance(p["age"], int) and not isinstance(p["age"], bool) and 0 <= p["age"] <= 120, text
    assert set(p["address"]) == {"city", "zip"} and isinstance(p["address"]["city"], str), text
    assert p["address"]["zip"] is None or (isinstance(p["address"]["zip"], str) and len(p["address"]["zip"]) <= 8)
    assert 1 <= len(p["colors"]) <= 2 and all(c in ("red", "green", "blue") for c in p["colors"]), text


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8,
              num_kv_blocks=256, show_progress=False)
    yield llm
    llm.close()


def chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)


def test_json_schema_greedy_and_sampled_n2(smol):
    prompt = chat(smol, "Describe a person as JSON: name, age, address (city, zip) and favourite colors.")
    greedy = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": SCHEMA})
    sampled = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=100,
                             structured_outputs={"json": json.dumps(SCHEMA)})
    outs = smol.generate([prompt, prompt], [greedy, sampled], use_tqdm=False)  # one batch: three matchers
    assert outs[0].token_ids[-1] in smol.engine.core.eos_token_ids
    for c in outs[0].outputs + outs[1].outputs:
        assert c.finish_reason == "stop"
        check_person(c.text)
    assert outs[1].outputs[0].token_ids != outs[1].outputs[1].token_ids  # seed + index: two draws


def test_masking_keeps_what_the_grammar_allows(smol):
    """Greedy under a grammar that allows exactly the unconstrained text gives the same tokens; the logprobs are
    those of the allowed tokens (renormalised: never lower; forbidden ones -inf, as in vLLM), and once the text is
    complete only EOS may follow."""
    prompt = "The capital of France is"
    free = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0]
    assert free.finish_reason == "length"
    constraint = Constraint(choice=[free.text])
    held = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=3, structured_outputs=constraint),
                         use_tqdm=False)[0]
    assert held.token_ids == free.token_ids and held.text == free.text
    for token, lp_free, lp_held in zip(free.token_ids, free.logprobs, held.logprobs):
        assert lp_held[token] >= lp_free[token] - 1e-4 and not math.isinf(lp_held[token])
        assert sum(not math.isinf(v) for v in lp_held.values()) <= sum(not math.isinf(v) for v in lp_free.values())
    longer = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=20, structured_outputs=constraint),
                           use_tqdm=False)[0]
    assert longer.token_ids == free.token_ids + [longer.token_ids[-1]] and longer.finish_reason == "stop"
    assert longer.token_ids[-1] in smol.engine.core.eos_token_ids and longer.text == free.text


def test_regex_choice_and_the_rest_of_sampling(smol):
    """Regex and choice outputs fit; penalties, logit_bias, top-k/top-p and stop strings apply within the grammar."""
    outs = smol.generate(
        [chat(smol, "When was the Eiffel Tower finished? Give the date."), chat(smol, "What color is the sky?"),
         chat(smol, "Pick a fruit.")],
        [SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
         SamplingParams(temperature=0.7, seed=1, top_k=20, top_p=0.9, repetition_penalty=1.3, max_tokens=10,
                        structured_outputs={"choice": ["blue", "green", "red"]}),
         SamplingParams(temperature=0, max_tokens=10, logit_bias={smol.tokenizer.encode("banana")[0]: 100},
                        stop=["an"], structured_outputs={"choice": ["apple", "banana"]})], use_tqdm=False)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("blue", "green", "red") and outs[1].finish_reason == "stop"
    assert outs[2].text == "b" and outs[2].finish_reason == "stop"  # "banana" (its first token is favoured) ...
    assert outs[2].outputs[0].stop_reason == "an"  # ... cut at its stop string


def test_min_tokens_past_the_grammar_ends_it_there(smol):
    """min_tokens bans EOS, but the grammar allows nothing else once complete: the sequence ends with the grammar."""
    out = smol.generate(chat(smol, "A number?"), SamplingParams(temperature=0, max_tokens=10, min_tokens=8,
                                                                  structured_outputs={"regex": "[0-9]{2}"}),
                        use_tqdm=False)[0]
    assert re.fullmatch("[0-9]{2}", out.text) and out.finish_reason == "stop"
    assert all(t not in smol.engine.core.eos_token_ids for t in out.token_ids)


def test_stream_concatenates_to_the_result(smol):
    params = SamplingParams(temperature=0.5, seed=2, max_tokens=20,
                            structured_outputs={"regex": r"[A-Z][a-z]+ [0-9]{1,3}"})
    prompt = chat(smol, "Name a street and a house number.")
    deltas = list(smol.stream(prompt, params))
    whole = smol.generate(prompt, params, use_tqdm=False)[0]
    assert "".join(d.text for d in deltas) == whole.text and deltas[-1].finish_reason == whole.finish_reason == "stop"
    assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{1,3}", whole.text)


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "a(b"}, "structured_outputs.regex: Regex parsing error at position 4: The parenthesis is not closed."),
    ({"json": {"type": "object", "properties": {"a": {"type": "wat"}}}}, 'structured_outputs.json: Unsupported type'),
    ({"grammar": 'root ::= "a" |'}, "structured_outputs.grammar: EBNF parser error"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar: Lark error"),
])
def test_bad_grammar_raises_before_anything_runs(smol, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        smol.generate(["ok", "fine"], [SamplingParams(max_tokens=2), SamplingParams(structured_outputs=constraint)],
                      use_tqdm=False)
    assert not smol.engine.has_unfinished_requests() and not smol.engine.core.has_unfinished_requests()


def test_a_grammar_the_core_cannot_compile_finishes_with_an_error(smol):
    """The core compiles what reaches it unchecked on its pool: a failure is that request's error, nobody else's."""
    core = smol.engine.core
    ids = smol.tokenizer.encode("Hello")
    core.add_request(EngineRequest("bad", ids, SamplingParams(structured_outputs={"regex": "(("})))
    core.add_request(EngineRequest("good", ids, SamplingParams(max_tokens=3, structured_outputs={"regex": "[a-z]+"})))
    outputs = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["bad"][-1].finish_reason == "error" and "Regex parsing error" in outputs["bad"][-1].error
    assert outputs["good"][-1].finish_reason == "length"


def constrained_mix(llm: LLM) -> tuple[list, list]:
    """Seeded and unseeded constrained requests with unconstrained ones (a penalised one, briefly): token ids, texts."""
    params = [SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs={"regex": "(ab|c)+d"}),
              SamplingParams(temperature=1.0, seed=5, max_tokens=30),
              SamplingParams(temperature=1.0, seed=6, n=2, max_tokens=30, structured_outputs={"choice": ["xy", "z"]}),
              SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, structured_outputs={"regex": "[a-c]{5,30}"})]
    outs = llm.generate(["a", "b", "c", "d", "e"], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], [[c.text for c in o.outputs] for o in outs]


def test_async_loop_gives_the_synchronous_tokens(tiny_model_dirs, monkeypatch):
    """The split launch (forward, then the previous step read, then the masked sampler) gives the synchronous loop's
    tokens, and does overlap: most deferred samplers are launched with the step before them still unread."""
    from nanoserve.engine.core import EngineCore

    overlapped = []
    original = EngineCore._start_deferred
    monkeypatch.setattr(EngineCore, "_start_deferred", lambda self: overlapped.append(bool(len(self._pipeline))) or
                        original(self))
    runs = []
    for overlap in (True, False):
        overlapped.clear()
        with LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=128, max_num_seqs=8, num_kv_blocks=64,
                 async_scheduling=overlap, show_progress=False) as llm:
            ids, texts = constrained_mix(llm)
        runs.append(ids)
        assert re.fullmatch("(ab|c)+d", texts[0][0]) or len(ids[0][0]) == 40
        assert all(t in ("xy", "z") for t in texts[2]) and re.fullmatch("[a-c]{5,30}", texts[4][0])
        assert (sum(overlapped) > len(overlapped) // 2) if overlap else (overlapped and not any(overlapped))
    assert runs[0] == runs[1]


def test_tensor_parallel_ranks_apply_the_same_masks(tiny_model_dirs):
    """Two gloo ranks: the deferred sampler and its bitmask reach the worker, which samples the same tokens."""
    from tests.runner.test_tensor_parallel import last_tokens

    options = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8, num_kv_blocks=64,
                   show_progress=False)
    with LLM(str(tiny_model_dirs["llama"]), **options) as llm:
        want = constrained_mix(llm)
    with LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, **options) as llm:
        got = constrained_mix(llm)
        per_rank = llm.engine.core.runner.on_every_rank(last_tokens)
    assert got == want and per_rank[0] == per_rank[1]


def test_sampler_masks_only_the_grammar_rows_and_the_padding(tiny_model_dirs):
    """Logits wider than the tokenizer (padding columns given the largest logits): the grammar row takes the best
    token whose text fits, found here by decoding the whole vocabulary; the other rows sample as without it."""
    from nanoserve.engine.batching import sampling_batch
    from nanoserve.engine.grammar import Grammars
    from nanoserve.engine.sequence import Sequence
    from nanoserve.model_files import load_tokenizer
    from nanoserve.runner.sampler import Sampler, SamplingTensors

    tok = load_tokenizer(tiny_model_dirs["qwen3"])
    width = len(tok) + 40
    grammars = Grammars(lambda: tok, width, [tok.eos_token_id], 3, pin_memory=False)
    logits = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
    logits[:, len(tok):] = 50.0

    def sample(constrained: bool) -> list[int]:
        seqs = [Sequence(str(i), [1], SamplingParams(temperature=t, seed=3)) for i, t in enumerate((0, 0, 1.0))]
        for i, s in enumerate(seqs):
            s.slot, s.num_pending, s.generator = i, 1, s.params.make_generator("cpu")
        if constrained:
            seqs[1].grammar = grammars.matcher(grammars.compile(Constraint(regex="[0-9]+")).result())
        batch = sampling_batch(seqs, [tok.eos_token_id])
        fill = grammars.start_fill([s.grammar for s in seqs])
        if fill is not None:
            batch.grammar_rows, batch.grammar_bitmask = fill.result()
        params = SamplingTensors(*(torch.from_numpy(a) for a in (batch.temperature, batch.top_p, batch.top_k,
                                                                   batch.min_p)))
        last, slots = torch.zeros(3, dtype=torch.int32), torch.arange(3, dtype=torch.int32)
        return Sampler(3, torch.device("cpu"))(logits.clone(), batch, params, last, slots).result().token_ids

    free, held = sample(False), sample(True)
    digits = [t for t in range(len(tok)) if re.fullmatch("[0-9]+", tok.decode([t]))]
    assert digits and held[1] == max(digits, key=lambda t: logits[1, t].item())
    assert held[0] == free[0] == free[1] >= len(tok) and held[2] == free[2]  # padding wins where nothing masks it
    grammars.close()


@pytest.mark.gpu
def test_on_cuda_graph_replays_mask_and_keep_the_synchronous_tokens(tiny_model_dirs):
    """CUDA graphs, the pinned bitmask copied without blocking and xgrammar's Triton kernel: the outputs fit, and
    the split launch gives the synchronous loop's tokens."""
    runs = []
    for overlap in (True, False):
        with LLM(str(tiny_model_dirs["qwen3"]), device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8,
                 async_scheduling=overlap, show_progress=False) as llm:
            ids, texts = constrained_mix(llm)
            assert llm.engine.stats.decode_steps_graph > 0
        runs.append(ids)
        assert all(t in ("xy", "z") for t in texts[2]) and re.fullmatch("[a-c]{5,30}", texts[4][0])
    assert runs[0] == runs[1]


def test_the_grammar_cache_is_bounded_in_bytes_and_a_huge_grammar_is_refused(tiny_model_dirs):
    """Issue 39, 2: the cache was bounded by count only (eight 50k-value enums held ~1.45 GB). It now holds at most
    cache_bytes of compiled grammars, least recently used dropped first, and refuses one larger than max_bytes."""
    from nanoserve.engine.grammar import Grammars
    from nanoserve.model_files import load_tokenizer

    tok = load_tokenizer(tiny_model_dirs["qwen3"])
    grammars = Grammars(lambda: tok, len(tok), [tok.eos_token_id], 2, pin_memory=False)
    enums = [Constraint(json={"enum": [f"value-{k}-{i}" for i in range(300)]}) for k in range(6)]
    sizes = [grammars.compile(so).result().memory_size_bytes for so in enums[:2]]
    assert grammars.cached_bytes == sum(sizes) and min(sizes) > 0
    grammars.cache_bytes = int(2.5 * max(sizes))
    for so in enums[2:]:
        grammars.compile(so).result()
        assert grammars.cached_bytes <= grammars.cache_bytes
    assert len(grammars._cache) == 2 and enums[-1].key in grammars._cache and enums[0].key not in grammars._cache
    grammars.max_bytes = 1024
    with pytest.raises(ValueError, match=r"its compiled grammar takes [\d.]+ [KM]iB, more than this server allows"):
        grammars.compile(Constraint(json={"enum": [f"other-{i}" for i in range(300)]})).result()
    grammars.close()


def test_a_compile_past_its_deadline_is_refused_once_and_its_late_result_cached(tiny_model_dirs):
    """Issue 39, 2: a compile that outlasts compile_seconds fails its waiting future (expire(), as the core polls);
    the same constraint is refused on that future meanwhile without a second compile; one that never got a thread is
    cancelled, not remembered; the late result lands in the cache (under the byte limit as any other)."""
    from nanoserve.engine.grammar import Grammars
    from nanoserve.model_files import load_tokenizer

    tok = load_tokenizer(tiny_model_dirs["qwen3"])
    grammars = Grammars(lambda: tok, len(tok), [tok.eos_token_id], 2, pin_memory=False)
    grammars.compile_seconds = 0.2
    real, release, calls = grammars._compile, threading.Event(), []

    def slow(so):
        calls.append(so.key)
        assert release.wait(30)
        return real(so)

    grammars._compile = slow
    slow_so, other, queued = (Constraint(regex=r) for r in ("[a-c]{3}", "[d-f]{3}", "[g-i]{3}"))
    first, _, third = grammars.compile(slow_so), grammars.compile(other), grammars.compile(queued)
    grammars.expire()  # not yet
    assert not first.done() and grammars.compile(slow_so) is first
    time.sleep(0.25)
    grammars.expire()
    with pytest.raises(ValueError, match=r"it did not compile within 0.2 s, the most this server allows for one"):
        first.result(0)
    with pytest.raises(ValueError, match="no grammar compile thread came free within 0.2 s"):
        third.result(0)
    again = grammars.compile(slow_so)  # refused at once, on the same compile
    assert again is first and calls.count(slow_so.key) == 1 and queued.key not in calls
    release.set()
    deadline = time.monotonic() + 10
    while slow_so.key in grammars._compiling or other.key in grammars._compiling:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    late = grammars.compile(slow_so)
    assert late.result(0) is not None and grammars.cached_bytes > 0 and calls.count(slow_so.key) == 1
    assert grammars.compile(queued).result(10) is not None  # cancelled before it ran: compiled afresh now
    grammars.close()
