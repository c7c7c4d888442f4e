"""Chat templates sent in requests (--trust-request-chat-template): rendered in a sandbox process, with a
time limit (the worker is killed and replaced) and a cap on what they render; other clients keep streaming
while a hostile template runs; every failure is a 400 in OpenAI's format."""
from __future__ import annotations

import threading
import time

import openai
import pytest

from nanoserve.server import build_app
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.tool_parsers import HermesParser

MODEL = "tiny"
TIMEOUT_S = 1.0
SIMPLE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def trusted(model_dir, serve_app):
    app = build_app(model_dir, served_model_name=MODEL, trust_request_chat_template=True,
                    chat_template_timeout_s=TIMEOUT_S, device="cpu", max_num_seqs=8, max_model_len=256,
                    num_kv_blocks=256, show_progress=False)
    return serve_app(app)


def chat(server, template, **kw):
    return server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, extra_body={"chat_template": template}, **kw)


def test_a_request_template_renders(trusted):
    r = chat(trusted, SIMPLE)
    assert r.usage.prompt_tokens == len(trusted.prompt_tokenizer.encode("user: Hi\nassistant:",
                                                                        add_special_tokens=False))


@pytest.mark.parametrize("template,words", [
    ("{% for %}", "could not render"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ ''.__class__.__mro__ }}", "could not render"),  # Jinja's sandbox
    ("{{ 'x' * 10**7 }}", "rendered 10000000 characters"),
    ("{{ 'x' * 10**11 }}", "more memory"),
])
def test_bad_templates_are_400(trusted, template, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(trusted, template)
    assert words in err.value.body["message"] and err.value.body["param"] == "chat_template"


def test_a_slow_template_is_cut_off_while_others_stream(trusted):
    arrivals, started = [], threading.Event()

    def stream():
        for chunk in trusted.client().completions.create(model=MODEL, prompt="Tell me a story", max_tokens=200,
                                                          stream=True, extra_body={"ignore_eos": True}):
            arrivals.append(time.monotonic())
            if len(arrivals) == 3:
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        chat(trusted, SLOW)
    t1 = time.monotonic()
    reader.join(60)
    assert f"did not render within {TIMEOUT_S:g} s" in err.value.body["message"]
    assert TIMEOUT_S <= t1 - t0 < TIMEOUT_S + 2
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1]
    assert gaps and max(gaps) < 0.25, "the stream must not wait for the template (it renders in another process)"
    r = chat(trusted, SIMPLE)  # a fresh worker took over
    assert r.usage.completion_tokens == 2


def test_tools_reach_a_request_template_and_choose_its_parser(trusted):
    """The sandbox renders `tools` as the model's own template gets them; with --tool-call-parser auto, a request
    template that asks for <tool_call> has tool_choice "auto" outputs read by the hermes parser."""
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" + SIMPLE + "<tool_call>"
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    r = chat(trusted, template, tools=tools)
    expected = "[get_weather][get_time]user: Hi\nassistant:<tool_call>"
    assert r.usage.prompt_tokens == len(trusted.prompt_tokenizer.encode(expected, add_special_tokens=False))
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                 "tools": tools, "chat_template": template})
    assert trusted.app.state.server.tool_calling(body).new_parser().__class__ is HermesParser
    assert not trusted.app.state.server.tool_calling(body.model_copy(update={"chat_template": SIMPLE})).parses
