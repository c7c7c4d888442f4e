"""What OpenAI-API clients send beyond the basics, against a real `nanoserve serve org/name` (a hub id, resolved
offline from a hub cache populated here) with the official openai client: logit_bias, echo with prompt
logprobs, and vLLM's /version, /ping, /tokenize, /detokenize."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.hub_cache import populate_hub_cache

REPO = "tiny-org/tiny-qwen3"
MAX_MODEL_LEN = 256
PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dirs):
    """`nanoserve serve tiny-org/tiny-qwen3` (positional, as `vllm serve MODEL`) with HF_HUB_OFFLINE=1."""
    root = tmp_path_factory.mktemp("surface")
    tiny = tiny_model_dirs["qwen3"]
    populate_hub_cache(root / "hub", REPO, {p.name: p for p in tiny.iterdir() if p.is_file()})
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "hub"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "nanoserve", "serve", REPO, "--port", str(port), "--device", "cpu",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    log = root / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log)
        yield base, log
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, base: str, log) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_served_under_its_hub_id(client, server):
    assert [m.id for m in client.models.list()] == [REPO]


# -- logit_bias ------------------------------------------------------------------------------------------
def test_plus_100_forces_a_token(client):
    for temperature in (0.0, 1.0):
        out = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=8, temperature=temperature, seed=3,
                                        logit_bias={"42": 100}, extra_body={"return_token_ids": True,
                                                                             "ignore_eos": True})
        assert _ids(out.choices[0]) == [42] * 8
    chat = client.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logit_bias={"77": 1000},  # clamped to 100, still forces it
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    assert _ids(chat.choices[0]) == [77] * 4


def test_minus_100_forbids_tokens(client):
    kw = dict(model=REPO, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True,
                                                                                  "ignore_eos": True})
    greedy = _ids(client.completions.create(**kw).choices[0])
    banned = {str(t): -100 for t in greedy}
    steered = _ids(client.completions.create(**kw, logit_bias=banned).choices[0])
    assert len(steered) == 8 and not set(steered) & set(greedy), (greedy, steered)
    # a batch where one request has a bias and another has none: the other is untouched
    both = client.completions.create(**{**kw, "prompt": [PROMPT, PROMPT]})
    assert [_ids(c) for c in both.choices] == [greedy, greedy]


@pytest.mark.parametrize("bias, says", [
    ({str(i): 1 for i in range(301)}, "at most 300 tokens"),
    ({"abc": 1}, "keys must be token ids"),
    ({"999999": 1}, "outside the vocabulary"),
    ({"5": "x"}, "logit_bias"),
])
def test_bad_logit_bias_is_a_400(client, bias, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=REPO, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert says in e.value.body["message"] and e.value.body["param"] == "logit_bias", e.value.body


# -- echo -----------------------------------------------------------------------------------------------
def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = client.completions.create(model=REPO, prompt=[PROMPT, "x"], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[1].text.startswith("x")
    ids = client.completions.create(model=REPO, prompt=[5, 6, 7], max_tokens=2, echo=True)
    assert ids.choices[0].text.startswith(client_detokenize(client, [5, 6, 7]))


def client_detokenize(client, tokens) -> str:
    return httpx.post(str(client.base_url).removesuffix("/v1/") + "/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_echo_with_logprobs_scores_the_prompt(client, server):
    prompt_ids = httpx.post(server[0] + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])  # the top 2, plus the token itself if not in them
    assert "".join(lp.tokens[:len(prompt_ids)]) == PROMPT and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(prompt_ids)] == len(PROMPT)
    # max_tokens 0: the prompt alone, with the same prompt logprobs (a scoring request, as lm-eval sends)
    score = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    s = score.choices[0]
    assert s.text == PROMPT and s.logprobs.tokens == lp.tokens[:len(prompt_ids)]
    assert s.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(prompt_ids)], abs=1e-5)


def test_echo_streamed_equals_echo_whole(client):
    kw = dict(model=REPO, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1, n=2)
    whole = client.completions.create(**kw)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    for c in whole.choices:
        assert texts[c.index] == c.text and tokens[c.index] == c.logprobs.tokens


def test_echo_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=REPO, prompt=PROMPT, max_tokens=0)


# -- vLLM's small routes ----------------------------------------------------------------------------------
def test_version_and_ping(server):
    assert httpx.get(server[0] + "/version").json() == {"version": "0.1.0"}
    assert httpx.get(server[0] + "/ping").status_code == 200 and httpx.post(server[0] + "/ping").status_code == 200


def test_tokenize_and_detokenize(server):
    base = server[0]
    t = httpx.post(base + "/tokenize", json={"model": REPO, "prompt": PROMPT, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == MAX_MODEL_LEN
    assert len(t["token_strs"]) == t["count"]
    assert httpx.post(base + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": PROMPT}
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(base + "/tokenize", json={"messages": messages}).json()
    bare = httpx.post(base + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert chat["count"] > bare["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    assert chat["token_strs"] is None


@pytest.mark.parametrize("path, body, status, says", [
    ("/tokenize", {}, 400, "either `prompt` or `messages`"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "either"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "Unrecognized request argument supplied: bogus"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_errors(server, path, body, status, says):
    r = httpx.post(server[0] + path, json=body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
