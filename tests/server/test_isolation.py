"""One client's work does not stall everyone's (issue 39, item 3), on the package's live server: a schema whose check
takes xgrammar seconds is answered 400 at the check's time budget, on threads of its own, while a small chat with
`stop` is answered at once; two multi-megabyte /tokenize bodies do not delay a chat prompt's tokenization."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SMALL_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": ["\n\n"]}


def _slow_schema(repeats: int) -> dict:
    """A pattern xgrammar takes about a second (CPU) to turn into a grammar."""
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^(ab|cd){{1,{repeats}}}$"}},
            "required": ["a"]}


def _post(base_url: str, path: str, body: dict, answers: list, timeout: float = 60) -> None:
    start = time.monotonic()
    response = httpx.post(base_url + path, json=body, headers=HEADERS, timeout=timeout)
    answers.append((time.monotonic() - start, response))


def _in_threads(*calls) -> list[threading.Thread]:
    threads = [threading.Thread(target=_post, args=call) for call in calls]
    for thread in threads:
        thread.start()
    return threads


@pytest.fixture
def checker(live):
    """The live server's constraint checks with a budget of 0.3 s (its default is seconds)."""
    checker = live.app.state.server.preprocessor.constraints
    budget, checker.timeout_s = checker.timeout_s, 0.3
    yield checker
    checker.timeout_s = budget


def test_a_slow_schema_is_a_400_at_its_budget_and_stalls_no_one(live, checker):
    refused: list = []
    attack = [(live.base_url, "/v1/chat/completions",
               {**SMALL_CHAT, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": _slow_schema(n)}}}, refused)
              for n in (1500, 1501)]
    threads = _in_threads(*attack)
    time.sleep(0.1)
    small: list = []
    _post(live.base_url, "/v1/chat/completions", SMALL_CHAT, small)
    for thread in threads:
        thread.join(60)
    assert small[0][1].status_code == 200 and small[0][0] < 2.0, small
    for seconds, response in refused:
        assert response.status_code == 400 and seconds < 2.0, (seconds, response.text)
        error = response.json()["error"]
        assert "took longer than 0.3 s to check" in error["message"] and error["param"] == "response_format"
    deadline = time.monotonic() + 30  # the checks run on; once over, their schemas are refused at once
    while len(checker._slow) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    again: list = []
    _post(live.base_url, "/v1/chat/completions", attack[0][2], again)
    assert again[0][1].status_code == 400 and again[0][0] < 0.25, again


def test_tokenize_bodies_of_megabytes_do_not_delay_a_chat(live):
    text = "hello world, this is a test. " * (2 * 2**20 // 29)  # 2 MB: seconds of tokenizing each
    answers: list = []
    threads = _in_threads(*[(live.base_url, "/tokenize", {"model": MODEL, "prompt": text}, answers)] * 2)
    time.sleep(0.5)  # both received: one tokenizing, one waiting
    small: list = []
    _post(live.base_url, "/v1/chat/completions", SMALL_CHAT, small)
    for thread in threads:
        thread.join(120)
    assert small[0][1].status_code == 200 and small[0][0] < 1.5, small
    assert len(answers) == 2 and all(r.status_code == 200 and r.json()["count"] > 2**19 for _, r in answers)
    assert max(seconds for seconds, _ in answers) > small[0][0]  # the chat was answered while they ran
