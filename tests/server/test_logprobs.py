"""Logprob bytes are each token's real bytes: for a byte-level BPE token that is part of a UTF-8 character
they are that byte, not U+FFFD's three; the bytes of a text's tokens concatenate to the text's UTF-8."""
from __future__ import annotations

import pytest

from nanoserve.model_files import load_tokenizer
from nanoserve.server.logprobs import TokenTexts

TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 🤖🚀 and ✓", "plain ascii, with punctuation!", "<|im_end|> special"]


@pytest.fixture(scope="module")
def texts(model_dir):
    return TokenTexts(load_tokenizer(model_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(texts, text):
    ids = texts.tokenizer.encode(text, add_special_tokens=False)
    assert bytes(b for t in ids for b in texts.bytes(t)) == text.encode("utf-8")


def test_partial_character_tokens_carry_their_own_byte(texts):
    ids = texts.tokenizer.encode("é", add_special_tokens=False)
    assert len(ids) == 2, "the tiny vocabulary splits é into its two UTF-8 bytes"
    assert [texts.bytes(t) for t in ids] == [[0xC3], [0xA9]]
    assert all(texts.text(t) == "\ufffd" for t in ids)  # alone, each decodes to the replacement character


def test_special_tokens_are_their_text(texts):
    (tid,) = texts.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert texts.bytes(tid) == list(b"<|im_start|>") and texts.text(tid) == "<|im_start|>"


def test_without_a_tokenizer():
    texts = TokenTexts(None)
    assert texts.text(7) == "token_id:7" and texts.bytes(7) is None
