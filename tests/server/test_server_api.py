"""The OpenAI API through the official `openai` client against a real server: completions and chat,
streaming and not, stop strings, max_tokens, n, seeds, logprobs; greedy text == the offline LLM's."""
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

from nanoserve import SamplingParams

MODEL = "tiny"  # served_model_name of the `live` server (tests/server/conftest.py)
PROMPTS = ["The capital of France is", "Once upon a time there was", "Hello, world! How are"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, what is your name?"}]


def greedy(offline, prompt, max_tokens, **kw):
    return offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), use_tqdm=False)[0]


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_health_and_models(live):
    assert httpx.get(live.base_url + "/health").json() == {"status": "ok"}
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert live.client().models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_stream_equals_offline(live, offline, prompt):
    ref = greedy(offline, prompt, 12)
    client = live.client()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_equals_stream_equals_offline(live, offline):
    ids = chat_ids(offline.tokenizer, MESSAGES)
    ref = greedy(offline, ids, 12)
    client = live.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason

    # without stream_options no chunk carries usage
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_prompt_lists_token_ids_and_n(live, offline):
    """A list of prompts × n: choice index = prompt index * n + completion index, each greedy == offline."""
    refs = [greedy(offline, p, 6) for p in PROMPTS[:2]]
    r = live.client().completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0].text, refs[0].text, refs[1].text, refs[1].text]
    assert r.usage.prompt_tokens == sum(len(x.prompt_token_ids) for x in refs)
    assert r.usage.completion_tokens == 2 * sum(len(x.token_ids) for x in refs)

    by_ids = live.client().completions.create(model=MODEL, prompt=[refs[0].prompt_token_ids,
                                                                    refs[1].prompt_token_ids],
                                              max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [refs[0].text, refs[1].text]
    one = live.client().completions.create(model=MODEL, prompt=refs[1].prompt_token_ids, max_tokens=6, temperature=0)
    assert one.choices[0].text == refs[1].text

    streamed: dict[int, str] = {}
    for c in live.client().completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2,
                                              stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {i: c.text for i, c in enumerate(r.choices)}


def _stop_candidate(text: str) -> tuple[int, str]:
    """A short printable stop string that first occurs after the first character."""
    for k in range(1, len(text) - 1):
        s = text[k:k + 2]
        if s.isascii() and s.isprintable() and s.strip() == s and text.index(s) == k:
            return k, s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(live, offline):
    ref = greedy(offline, PROMPTS[0], 24, ignore_eos=True)
    k, stop = _stop_candidate(ref.text)
    client = live.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "@@@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text[:k]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == ref.text[:k]
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == ref.text[:k + len(stop)]


def test_max_tokens_and_extras(live):
    client = live.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=7, temperature=0.8, top_p=0.9,
                                  extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01,
                                              "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, presence_penalty=0.5,
                                       frequency_penalty=0.5, extra_body={"ignore_eos": True, "min_tokens": 5})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # no max_tokens on chat: generation may run to max_model_len (it is capped there, not an error)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == live.engine_client.config.max_model_len and r.choices[0].finish_reason == "length"


def test_n_and_seed_reproducible(live):
    client = live.client()

    def run(seed):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, n=3, seed=seed,
                                      extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 48
        return [c.text for c in r.choices]

    a, b, c = run(1234), run(1234), run(4321)
    assert a == b
    assert a != c
    assert len(set(a)) > 1, "the n completions of a seeded request use seed, seed+1, ... and should differ"
    chat = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=99, n=2,
                                           extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [x.message.content for x in chat[0].choices] == [x.message.content for x in chat[1].choices]


def test_completion_logprobs(live):
    client = live.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and tok in top
        assert tok_lp <= 0 and tok_lp == pytest.approx(max(top.values()))  # greedy: the sampled token is the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]

    streamed_tokens, streamed_lps = [], []
    for c in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                       stream=True, extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].logprobs:
            streamed_tokens += c.choices[0].logprobs.tokens
            streamed_lps += c.choices[0].logprobs.token_logprobs
    assert streamed_tokens == lp.tokens
    assert streamed_lps == pytest.approx(lp.token_logprobs, abs=1e-4)

    zero = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, logprobs=0)
    assert all(len(top) == 1 for top in zero.choices[0].logprobs.top_logprobs)
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs(live):
    client = live.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        if "\ufffd" not in entry.token:  # a whole character (a part of one has its real bytes: test_logprobs.py)
            assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.bytes != list("\ufffd".encode("utf-8"))
    streamed = []
    for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].logprobs:
            streamed += c.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].logprobs is None


def test_chat_template_in_request_needs_the_trust_flag(live, monkeypatch):
    """`live` runs without --trust-request-chat-template: a request's template is refused, whatever it holds
    (tests/server/test_request_templates.py runs a server with the flag)."""
    client = live.client()
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template": template})
    assert "--trust-request-chat-template" in err.value.body["message"]
    assert err.value.body["param"] == "chat_template"
    monkeypatch.setattr(live.prompt_tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert "no chat template" in err.value.body["message"] and err.value.body["param"] == "chat_template"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nanoserve_serve_cli(model_dir):
    """`nanoserve serve` as a user runs it: default model name = the folder as given, 127.0.0.1, clean ^C."""
    port = _free_port()
    cmd = [sys.executable, "-m", "nanoserve", "serve", "--model", model_dir, "--port", str(port), "--device", "cpu",
           "--max-model-len", "128", "--max-num-seqs", "4", "--num-kv-blocks", "64", "--api-key", "k"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model_dir]
        r = client.completions.create(model=model_dir, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert httpx.get(base + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out


TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.content is not none %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}|{% endfor %}<assistant>")


def test_tool_call_messages_reach_the_chat_template(live, monkeypatch):
    """Messages as real clients send them after a tool call: the assistant's tool_calls with content null, the
    tool's answer with its tool_call_id; both reach the template (arguments as an object, as vLLM passes them)."""
    monkeypatch.setattr(live.prompt_tokenizer, "chat_template", TOOL_TEMPLATE)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    r = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    expected = ('<user>Weather in Paris?|<assistant>[call call_1 weather {"city": "Paris"}]|'
                "<tool>21 C[answers call_1]|<assistant>")
    assert r.usage.prompt_tokens == len(live.prompt_tokenizer.encode(expected, add_special_tokens=False))


def test_null_content_reaches_templates_that_concatenate_it(live, monkeypatch):
    """An assistant message that only called tools (content null) renders in a template that adds
    message['content'] to a string, as SmolLM2's does; null arrives as ""."""
    monkeypatch.setattr(live.prompt_tokenizer, "chat_template",
                        "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '|' }}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    r = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    expected = "<user>Weather?|<assistant>|<tool>21 C|"
    assert r.usage.prompt_tokens == len(live.prompt_tokenizer.encode(expected, add_special_tokens=False))


def test_response_format_text_is_accepted_and_unknown_types_refused(live):
    """(json_object and json_schema: tests/server/test_structured_outputs_api.py)"""
    client, chat = live.client(), [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"response_format": {"type": "text"}})
    assert len(r.choices) == 1
    with pytest.raises(openai.BadRequestError, match="must be"):
        client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, response_format={"type": "xml"})
