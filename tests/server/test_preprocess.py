"""Prompt preprocessing: the character bound never refuses a prompt that fits (tokens >= chars / bound),
a prompt too long for max_model_len is refused before the tokenizer sees it, and tokenization runs on the
tokenizer thread, not the caller's."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from nanoserve.model_files import load_tokenizer
from nanoserve.server.preprocess import Preprocessor, chars_per_token_bound
from nanoserve.errors import RequestError
from nanoserve.server.request_body import APIError

SAMPLES = ["The quick brown fox jumps over the lazy dog. " * 20, "héllo wörld ünïcödé " * 30, "日本語のテキスト" * 40,
           "🤖🚀✓ " * 50, "<|im_start|><|im_end|><|begin_of_text|>" * 10, "capital capital capital " * 40,
           "    \n\n\t\t    " * 30]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.mark.parametrize("text", SAMPLES)
def test_the_bound_holds(tokenizer, text):
    bound = chars_per_token_bound(tokenizer)
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / bound


def test_the_bound_holds_on_random_text(tokenizer):
    rng = random.Random(0)
    alphabet = [chr(c) for c in (*range(32, 127), *range(0xA0, 0x250), *range(0x3040, 0x30FF))] + ["Ġ", "<|im_end|>"]
    bound = chars_per_token_bound(tokenizer)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400)))
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / bound


class _Spy:
    """The tokenizer, recording which threads encode (and refusing to, when told)."""

    def __init__(self, tokenizer, allow=True):
        self._tokenizer, self.allow, self.threads = tokenizer, allow, []

    def encode(self, *args, **kwargs):
        assert self.allow, "this prompt should have been refused before tokenization"
        self.threads.append(threading.current_thread().name)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_too_long_is_refused_before_tokenizing(tokenizer):
    spy = _Spy(tokenizer, allow=False)
    pre = Preprocessor(spy, len(tokenizer), max_model_len=64)
    try:
        with pytest.raises(APIError) as err:
            asyncio.run(pre.completion_prompts(["x" * (pre.max_chars + 1)]))
        assert err.value.status == 400 and "max_model_len is 64" in err.value.message
        with pytest.raises(APIError) as err:  # a chat whose rendering is already too long
            asyncio.run(pre.chat_prompt([{"role": "user", "content": "y" * pre.max_chars}], True))
        assert "max_model_len is 64" in err.value.message
    finally:
        pre.close()


def test_tokenization_runs_on_the_tokenizer_thread(tokenizer):
    spy = _Spy(tokenizer)
    pre = Preprocessor(spy, len(tokenizer), max_model_len=256)
    try:
        out = asyncio.run(pre.completion_prompts(["Hello world", [5, 6, 7], "Once upon a time"]))
        assert [ids for _, ids in out] == [tokenizer.encode("Hello world"), [5, 6, 7],
                                           tokenizer.encode("Once upon a time")]
        assert [t for t, _ in out] == ["Hello world", None, "Once upon a time"]
        ids = asyncio.run(pre.chat_prompt([{"role": "user", "content": "Hi"}], True))
        assert ids == tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                                     tokenize=False, add_generation_prompt=True),
                                       add_special_tokens=False)
        assert spy.threads and all(name.startswith("nanoserve-tokenizer") for name in spy.threads)
        with pytest.raises(RequestError, match="vocabulary") as err:  # the front end's rule, its field as data
            asyncio.run(pre.completion_prompts([[1, 10**6]]))
        assert err.value.param == "prompt"
    finally:
        pre.close()
