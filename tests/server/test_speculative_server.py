"""Speculative decoding through the OpenAI server (issue 38): a stream carries the same greedy text as the offline
engine without drafts, its deltas may hold several tokens, and /metrics carries the acceptance counters."""
from __future__ import annotations

import pytest

from nanoserve import SamplingParams
from nanoserve.server.app import build_app
from tests.server.conftest import API_KEY, ENGINE_OPTIONS, MODEL

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11]]


@pytest.fixture(scope="module")
def speculating(model_dir, serve_app):
    return serve_app(build_app(model_dir, api_key=API_KEY, served_model_name=MODEL, speculative_config=NGRAM,
                               **ENGINE_OPTIONS))


def assert_streams_greedy_text(server, offline, max_tokens: int) -> None:
    """Each prompt streamed greedily carries the offline engine's text without drafts."""
    client = server.client()
    for prompt in PROMPTS:
        want = offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)[0].text
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want


def test_stream_carries_the_greedy_text_and_metrics_the_acceptance(speculating, offline):
    assert_streams_greedy_text(speculating, offline, 40)
    speculating.wait_idle()
    snapshot = speculating.metrics()
    drafted = speculating.metric(snapshot, "nanoserve_spec_decode_num_draft_tokens_total", method="ngram")
    accepted = speculating.metric(snapshot, "nanoserve_spec_decode_num_accepted_tokens_total", method="ngram")
    assert drafted > 0 and 0 < accepted <= drafted


def test_a_draft_model_serves_the_same_stream(model_dir, serve_app, offline):
    """A draft model (the served model drafting for itself) through the server: the stream's greedy text is the
    offline engine's without drafts, and /metrics counts its drafts under method="draft_model", all accepted."""
    spec = f'{{"method": "draft_model", "model": "{model_dir}", "num_speculative_tokens": 3}}'
    server = serve_app(build_app(model_dir, api_key=API_KEY, served_model_name=MODEL, speculative_config=spec,
                                 **ENGINE_OPTIONS))
    assert_streams_greedy_text(server, offline, 30)
    server.wait_idle()
    snapshot = server.metrics()
    drafted = server.metric(snapshot, "nanoserve_spec_decode_num_draft_tokens_total", method="draft_model")
    accepted = server.metric(snapshot, "nanoserve_spec_decode_num_accepted_tokens_total", method="draft_model")
    assert drafted > 0 and accepted == drafted
