"""One front end under both paths: the offline LLM and the server run engine/frontend.FrontEnd (its validation,
queue check, fan-out and output processing not overridden), refuse the same bad request with the same text and
field, and give the same outputs for the same request; a RequestError carries its field as data and is answered
as OpenAI's error JSON."""
from __future__ import annotations

import openai
import pytest

from nanoserve import SamplingParams
from nanoserve.engine.engine import LLMEngine
from nanoserve.engine.frontend import FrontEnd
from nanoserve.errors import RequestError
from nanoserve.server.client import EngineClient

MODEL, MAX_MODEL_LEN = "tiny", 256  # the `live` server's served_model_name and max_model_len (conftest.py)

FRONT_END_METHODS = ("tokenize", "check_params", "check_fits", "add_requests", "abort_requests", "process_outputs")


def test_both_paths_are_the_one_front_end(live, offline):
    for engine, kind in ((offline.engine, LLMEngine), (live.engine_client, EngineClient)):
        assert isinstance(engine, FrontEnd)
        for name in FRONT_END_METHODS:  # the rules live in FrontEnd alone: neither path has its own copy
            assert getattr(kind, name) is getattr(FrontEnd, name), (kind, name)
    assert offline.engine.core_client.core is offline.engine.core  # in-process: the EngineCore itself
    assert type(live.engine_client.core_client).__name__ == "MPClient"  # over ZeroMQ


def test_sampling_params_errors_carry_their_field():
    with pytest.raises(RequestError) as err:
        SamplingParams(top_p=5)
    e = err.value
    assert isinstance(e, ValueError) and e.param == "top_p" and str(e) == "top_p must be a number in (0, 1], got 5"
    renamed = e.renamed("nucleus")
    assert renamed.param == "nucleus" and renamed.message == "nucleus must be a number in (0, 1], got 5"
    with pytest.raises(RequestError) as err:
        SamplingParams(min_tokens=5, max_tokens=2)
    assert err.value.param == "min_tokens"


def _offline_error(offline, prompt, **params) -> RequestError:
    with pytest.raises(RequestError) as err:
        offline.generate(prompt, SamplingParams(**params), use_tqdm=False)
    return err.value


BAD = [  # (what, prompt, sampling params): each refused by the front end's checks
    ("prompt id outside the vocabulary", [1, 10**6], {}),
    ("stop token id outside the vocabulary", [1, 2], {"stop_token_ids": [10**6]}),
    ("logit bias outside the vocabulary", [1, 2], {"logit_bias": {10**6: 1.0}}),
    ("prompt leaves no room", [1] * MAX_MODEL_LEN, {}),
]


@pytest.mark.parametrize("what, prompt, params", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_is_refused_alike_offline_and_over_the_server(live, offline, what, prompt, params):
    expected = _offline_error(offline, prompt, **params)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **params}
    if "logit_bias" in params:
        body["logit_bias"] = {str(t): v for t, v in params["logit_bias"].items()}
    with live.http() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": expected.message, "type": "invalid_request_error",
                                  "param": expected.param, "code": None}}
    assert not offline.engine.has_unfinished_requests() and offline.engine.output_processor.num_waiting == 0


def test_a_bad_sampling_param_is_refused_alike(live, offline):
    with pytest.raises(RequestError) as err:
        SamplingParams(temperature=-1.0)
    with pytest.raises(openai.BadRequestError) as api:
        live.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-1.0)
    assert api.value.body["message"] == err.value.message and api.value.body["param"] == "temperature"


def test_the_field_is_named_as_the_request_calls_it(live):
    """chat's max_completion_tokens is SamplingParams' max_tokens: the error names the request's own field."""
    with pytest.raises(openai.BadRequestError) as api:
        live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_completion_tokens=0)
    assert api.value.body["param"] == "max_completion_tokens"
    assert api.value.body["message"].startswith("max_completion_tokens must be")
    with live.http() as http:  # /detokenize runs the front end's vocabulary check, said of its `tokens`
        r = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_the_same_request_gives_the_same_outputs(live, offline):
    """n > 1 with seeds and a stop string: fanned out, sampled and cut by the same front end on both paths."""
    params = dict(n=3, seed=11, temperature=1.0, max_tokens=12, stop=["e"])
    prompt = [5, 17, 42, 99, 7]
    want = offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    got = live.client().completions.create(model=MODEL, prompt=prompt, extra_body={"return_token_ids": True},
                                           **params)
    assert [c.text for c in got.choices] == [c.text for c in want.outputs]
    assert [c.model_extra["token_ids"] for c in got.choices] == [c.token_ids for c in want.outputs]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in want.outputs]
    assert len({c.text for c in want.outputs}) > 1, "the n completions should differ (seed + i each)"
