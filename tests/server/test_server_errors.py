"""Malformed and hostile requests get the right 4xx in OpenAI's error format, and the server keeps serving
after each: on the same keep-alive connection, with /metrics still parsing."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"  # served_model_name of the `live` server (tests/server/conftest.py)
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def cmpl(**fields):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, method, path, body (dict → JSON, str → raw bytes), headers override, status, words the message must hold)
CASES = [
    ("bad-json", "POST", CMPL, '{"model": "tiny", "prompt": ', None, 400, "not valid JSON"),
    ("empty-body", "POST", CMPL, "", None, 400, "JSON"),
    ("json-array", "POST", CMPL, "[1, 2]", None, 400, "JSON object"),
    ("json-string", "POST", CHAT, '"hello"', None, 400, "JSON object"),
    ("missing-model", "POST", CMPL, without(cmpl(), "model"), None, 400, "model"),
    ("missing-prompt", "POST", CMPL, without(cmpl(), "prompt"), None, 400, "prompt"),
    ("unknown-field", "POST", CMPL, cmpl(best_of_luck=3), None, 400,
     "Unrecognized request argument supplied: best_of_luck"),
    ("unknown-model", "POST", CMPL, cmpl(model="gpt-9"), None, 404, "gpt-9"),
    ("negative-max-tokens", "POST", CMPL, cmpl(max_tokens=-5), None, 400, "max_tokens"),
    ("zero-max-tokens", "POST", CMPL, cmpl(max_tokens=0), None, 400, "max_tokens"),
    ("string-max-tokens", "POST", CMPL, cmpl(max_tokens="5"), None, 400, "max_tokens"),
    ("bool-max-tokens", "POST", CMPL, cmpl(max_tokens=True), None, 400, "max_tokens"),
    ("negative-temperature", "POST", CMPL, cmpl(temperature=-1), None, 400, "temperature"),
    ("string-temperature", "POST", CMPL, cmpl(temperature="hot"), None, 400, "temperature"),
    ("top-p-2", "POST", CMPL, cmpl(top_p=2), None, 400, "top_p"),
    ("top-p-0", "POST", CMPL, cmpl(top_p=0), None, 400, "top_p"),
    ("top-k-minus-2", "POST", CMPL, cmpl(top_k=-2), None, 400, "top_k"),
    ("min-p-1.5", "POST", CMPL, cmpl(min_p=1.5), None, 400, "min_p"),
    ("n-0", "POST", CMPL, cmpl(n=0), None, 400, "n must be"),
    ("huge-n", "POST", CMPL, cmpl(n=100000), None, 400, "n must be"),
    ("presence-penalty-3", "POST", CMPL, cmpl(presence_penalty=3), None, 400, "presence_penalty"),
    ("frequency-penalty--2.5", "POST", CHAT, chat(frequency_penalty=-2.5), None, 400, "frequency_penalty"),
    ("repetition-penalty-0", "POST", CMPL, cmpl(repetition_penalty=0), None, 400, "repetition_penalty"),
    ("min-tokens-over-max", "POST", CMPL, cmpl(min_tokens=5, max_tokens=2), None, 400, "min_tokens"),
    ("logprobs-21", "POST", CMPL, cmpl(logprobs=21), None, 400, "logprobs"),
    ("logprobs-negative", "POST", CMPL, cmpl(logprobs=-1), None, 400, "logprobs"),
    ("stop-int", "POST", CMPL, cmpl(stop=5), None, 400, "stop"),
    ("stop-empty-string", "POST", CMPL, cmpl(stop=[""]), None, 400, "stop"),
    ("stop-token-ids-negative", "POST", CMPL, cmpl(stop_token_ids=[-1]), None, 400, "stop_token_ids"),
    ("seed-string", "POST", CMPL, cmpl(seed="42"), None, 400, "seed"),
    ("stream-string", "POST", CMPL, cmpl(stream="yes"), None, 400, "stream"),
    ("stream-options-unknown", "POST", CMPL, cmpl(stream=True, stream_options={"usage": True}), None, 400,
     "stream_options.usage"),
    ("prompt-empty-list", "POST", CMPL, cmpl(prompt=[]), None, 400, "prompt"),
    ("prompt-empty-string", "POST", CMPL, cmpl(prompt=""), None, 400, "empty"),
    ("prompt-dict", "POST", CMPL, cmpl(prompt={"text": "hi"}), None, 400, "prompt"),
    ("prompt-mixed-list", "POST", CMPL, cmpl(prompt=[[1, 2], "x"]), None, 400, "prompt"),
    ("token-id-negative", "POST", CMPL, cmpl(prompt=[1, -1]), None, 400, "token id -1"),
    ("token-id-huge", "POST", CMPL, cmpl(prompt=[1, 10**9]), None, 400, "vocabulary"),
    ("token-id-float", "POST", CMPL, cmpl(prompt=[1, 2.5]), None, 400, "prompt"),
    ("prompt-too-long-ids", "POST", CMPL, cmpl(prompt=[5] * 300), None, 400, "max_model_len"),
    ("prompt-too-long-text", "POST", CMPL, cmpl(prompt="hello world " * 400), None, 400, "max_model_len"),
    ("one-bad-prompt-in-list", "POST", CMPL, cmpl(prompt=["fine", "hello world " * 400]), None, 400, "max_model_len"),
    ("chat-empty-messages", "POST", CHAT, chat(messages=[]), None, 400, "messages"),
    ("chat-missing-messages", "POST", CHAT, without(chat(), "messages"), None, 400, "messages"),
    ("chat-missing-role", "POST", CHAT, chat(messages=[{"content": "hi"}]), None, 400, "role"),
    ("chat-bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400, "role"),
    ("chat-content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 7}]), None, 400, "content"),
    ("chat-image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), None, 400, "content"),
    ("chat-messages-not-list", "POST", CHAT, chat(messages="hi"), None, 400, "messages"),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    ("chat-top-logprobs-50", "POST", CHAT, chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs"),
    ("chat-logprobs-int", "POST", CHAT, chat(logprobs=5), None, 400, "logprobs"),
    ("chat-max-completion-tokens-negative", "POST", CHAT, chat(max_completion_tokens=-1), None, 400,
     "max_completion_tokens must be"),
    ("chat-template-untrusted", "POST", CHAT, chat(chat_template="{% for %}"), None, 400,
     "--trust-request-chat-template"),
    ("chat-null-content", "POST", CHAT, chat(messages=[{"role": "user", "content": None}]), None, 400, "content"),
    ("chat-tool-without-call-id", "POST", CHAT, chat(messages=[{"role": "tool", "content": "42"}]), None, 400,
     "tool_call_id"),
    ("chat-tool-calls-on-user", "POST", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), None, 400, "tool_calls"),
    ("chat-unknown-model", "POST", CHAT, chat(model="other"), None, 404, "other"),
    ("no-api-key", "POST", CMPL, cmpl(), {"Authorization": ""}, 401, "API key"),
    ("wrong-api-key", "POST", CMPL, cmpl(), {"Authorization": "Bearer nope"}, 401, "API key"),
    ("wrong-auth-scheme", "GET", "/v1/models", None, {"Authorization": "Basic c2stdGVzdC1rZXk="}, 401, "API key"),
    ("bad-key-beats-bad-body", "POST", CMPL, "{not json", {"Authorization": "Bearer nope"}, 401, "API key"),
    ("unknown-route", "POST", "/v1/engines", cmpl(), None, 404, "Not Found"),
    ("wrong-method", "GET", CMPL, None, None, 405, "Method Not Allowed"),
]

# Hostile requests (issue 7): each a 400 in OpenAI's format, then the same connection serves a normal request.
HOSTILE = [
    ("surrogate-in-prompt", CMPL, '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "surrogate"),
    ("surrogate-as-model", CMPL, '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', "surrogate"),
    ("low-surrogate-in-chat", CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "surrogate"),
    ("surrogate-in-stop", CMPL, '{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}', "surrogate"),
    ("surrogate-as-key", CMPL, '{"model": "tiny", "prompt": "hi", "\\udbff": 1}', "surrogate"),
    ("surrogate-as-utf8-bytes", CMPL, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "UTF-8"),
    ("temperature-1e999", CMPL, '{"model": "tiny", "prompt": "hi", "temperature": 1e999}', "out of range"),
    ("top-p-minus-1e999", CMPL, '{"model": "tiny", "prompt": "hi", "top_p": -1e999}', "out of range"),
    ("temperature-nan", CMPL, '{"model": "tiny", "prompt": "hi", "temperature": NaN}', "not valid JSON"),
    ("penalty-infinity", CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                               '"presence_penalty": Infinity}', "not valid JSON"),
    ("stream-options-without-stream", CMPL, json.dumps(cmpl(stream_options={"include_usage": True})),
     "Stream options can only be defined when `stream=True`"),
    ("stream-options-stream-false", CHAT, json.dumps(chat(stream=False, stream_options={"include_usage": True})),
     "stream_options"),
    ("max-tokens-beyond-context", CMPL, json.dumps(cmpl(prompt=[5] * 200, max_tokens=100)),
     "maximum context length is 256 tokens. However, you requested 300 tokens (200 in the prompt, 100 in the "
     "completion)"),
    ("chat-max-completion-tokens-beyond", CHAT, json.dumps(chat(max_completion_tokens=1000)),
     "maximum context length is 256 tokens"),
    ("never-fits-the-queue", CMPL, json.dumps(cmpl(prompt=["x"] * 100, n=50)), "max_waiting_requests=4096"),
    ("stop-token-id-outside-vocab", CMPL, json.dumps(cmpl(stop_token_ids=[10**9])), "vocabulary"),
    ("huge-int", CMPL, json.dumps(cmpl(max_tokens=10**30)), "maximum context length"),
    ("chat-template-untrusted", CHAT, json.dumps(chat(chat_template="{{ 'x' * 10**9 }}")),
     "--trust-request-chat-template"),
]


@pytest.mark.parametrize("method,path,body,headers,status,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(live, method, path, body, headers, status, words):
    with live.http() as http:
        content = body if isinstance(body, str) or body is None else json.dumps(body)
        r = http.request(method, path, content=content,
                         headers={"Content-Type": "application/json", **(headers or {})})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err
    assert err["type"]


def _metrics_parse(conn: http.client.HTTPConnection) -> None:
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    assert r.status == 200
    assert list(text_string_to_metric_families(r.read().decode()))


@pytest.mark.parametrize("path,body,words", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_request_then_same_connection_serves(live, path, body, words):
    url = urlsplit(live.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {live.api_key}"}
    try:
        conn.request("POST", path, body=body if isinstance(body, bytes) else body.encode(), headers=headers)
        sock = conn.sock
        r = conn.getresponse()
        answer = json.loads(r.read())
        assert r.status == 400, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert words in answer["error"]["message"], answer
        assert not r.will_close, "an error response must keep the connection alive"
        conn.request("POST", CMPL, body=json.dumps(cmpl(max_tokens=3, ignore_eos=True)).encode(), headers=headers)
        assert conn.sock is sock, "the next request must go over the same connection"
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
        _metrics_parse(conn)
    finally:
        conn.close()


def test_huge_top_k_is_clamped_not_a_crash(live):
    """top_k beyond the vocabulary keeps every token (as off); it must never reach the core as an int32 overflow."""
    r = live.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0.7,
                                         extra_body={"top_k": 10**12, "ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_still_serving_after_bad_requests(live):
    r = live.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    live.wait_idle()


def test_unknown_model_is_openai_not_found(live):
    with pytest.raises(openai.NotFoundError) as err:
        live.client().completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_only_the_probes_need_no_key(live):
    """Issue 39: /tokenize and /detokenize were served without the key; every route but the probes takes it."""
    with live.http(auth=False) as http:
        for path in ("/health", "/metrics", "/version", "/ping"):
            assert http.get(path).status_code == 200, path
        assert http.post("/ping").status_code == 200
        assert http.get("/v1/models").status_code == 401
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
            r = http.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    with live.http() as http:
        assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
        assert http.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200


BODIES = {CMPL: cmpl(max_tokens=1), CHAT: chat(max_tokens=1), "/tokenize": {"prompt": "Hi"},
          "/detokenize": {"tokens": [1, 2]}}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_json_is_415(live, path, content_type):
    """Issue 39: what a web page may POST without a CORS preflight (text/plain, a form, multipart) was served."""
    with live.http() as http:
        r = http.post(path, content=json.dumps(BODIES[path]), headers={"Content-Type": content_type})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["message"].startswith("The request body must be JSON (Content-Type: application/json)")


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/vnd.api+json", None])
def test_json_bodies_are_served_whatever_their_json_type(live, content_type):
    """A charset or a +json type is JSON; no Content-Type at all is read as JSON (FastAPI's rule: requests.post(data=)
    sends none)."""
    with live.http() as http:
        headers = {"Content-Type": content_type} if content_type else {}
        request = http.build_request("POST", CMPL, content=json.dumps(BODIES[CMPL]), headers=headers)
        assert content_type or "content-type" not in request.headers
        r = http.send(request)
    assert r.status_code == 200, r.text


def test_queue_full_is_503_and_never_fitting_is_400(live, monkeypatch):
    """A full waiting queue is 503 (retry later); a request that could never fit it is 400 (split it)."""
    monkeypatch.setattr(live.engine_client, "max_waiting_requests", 2)
    client = live.client()
    with live.core_frozen(), live.http() as http:  # the core reads nothing: two sequences stay waiting
        with http.stream("POST", CMPL, json=cmpl(n=2, stream=True)) as r:
            assert r.status_code == 200
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
            assert err.value.status_code == 503 and err.value.body["code"] == "queue_full"
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=3)
            assert "max_waiting_requests=2" in err.value.body["message"]
    monkeypatch.undo()
    live.wait_idle()
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices


def httpx_health(live) -> int:
    with live.http() as http:
        return http.get("/health").status_code


def test_oversized_body_is_refused_before_it_is_read(live):
    """A huge Content-Length gets 413 at once (the body is never read into memory)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(live.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + live.api_key.encode() + b"\r\nContent-Length: 1000000000\r\n\r\n{")
        answer = b""
        while b'"code"' not in answer:  # headers and the JSON body may come in separate packets
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    text = answer.decode("latin-1")
    assert text.startswith("HTTP/1.1 413"), text
    assert "larger than" in text
    test_still_serving_after_bad_requests(live)


def test_surrogate_bytes_in_the_url_are_not_a_500(live):
    """A model name in the path as UTF-8 of a lone surrogate (%ED%A0%80) decodes to replacement characters: 404."""
    with live.http() as http:
        r = http.get("/v1/models/%ED%A0%80")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert http.get("/v1/models").status_code == 200  # the same client keeps serving
