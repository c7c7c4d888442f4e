"""Issue 39, 8: what current OpenAI SDKs and agent frameworks send, on the live server (tests/server/conftest.py):
fields that change nothing here are accepted and ignored (each name logged once), fields it honours keep their
checks."""
from __future__ import annotations

import logging

import pytest

from nanoserve.server import request_body

MODEL = "tiny"
ASK = [{"role": "user", "content": "Hi"}]
IGNORED = {"store": True, "metadata": {"run": "7"}, "service_tier": "auto", "reasoning_effort": "low",
           "modalities": ["text"], "prompt_cache_key": "k1", "safety_identifier": "u-1", "verbosity": "low",
           "user": "someone"}


def test_fields_agents_send_are_accepted_ignored_and_logged_once(live, monkeypatch, caplog):
    monkeypatch.setattr(request_body, "_logged_ignored", set())
    caplog.set_level(logging.INFO, logger="nanoserve.server")
    client = live.client()
    for _ in range(2):
        chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=IGNORED)
        assert chat.choices[0].message.role == "assistant"
        done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=IGNORED)
        assert done.usage.completion_tokens >= 1
    logged = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert sorted(logged) == sorted(f"request field {name!r} is accepted and ignored (logged once)" for name in IGNORED)


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"),
    ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options"),
    ({"functions": "get_weather"}, "tools"),
    ({"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "functions"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_fields_that_are_honoured_keep_their_checks(live, body, param):
    with live.http() as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **IGNORED, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
