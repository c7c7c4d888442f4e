"""Logprobs in OpenAI's two formats, with each token's text and its real bytes.

A byte-level BPE token (GPT-2, Llama 3, Qwen) can be part of a UTF-8 character: decoded alone it is
U+FFFD, so its bytes come from its vocabulary string mapped back through the byte-level alphabet
(transformers' bytes_to_unicode). Added tokens (specials) are their text; SentencePiece byte-fallback
tokens (<0x0A>) are that byte; anything else is the UTF-8 of its decoded text. Token texts and bytes
are cached per id (the vocabulary is finite).
"""
from __future__ import annotations

import logging
import re

logger = logging.getLogger("nanoserve.server")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int] | None:
    """The byte-level alphabet backwards (character → byte), from transformers, which has moved it over time."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        try:
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
        except ImportError:
            logger.warning("transformers has no bytes_to_unicode: logprob bytes come from each token's decoded text")
            return None
    return {c: b for b, c in bytes_to_unicode().items()}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hasattr(tokenizer, "byte_decoder")
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _finite(logprob: float | None) -> float | None:
    """-inf (and NaN) are not JSON: report them as -9999.0 (vLLM's convention for impossible tokens)."""
    if logprob is None:
        return None
    return max(-9999.0, logprob)


class TokenTexts:
    """Token id → its text (as OpenAI's logprobs show it) and its bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int] | None] = {}
        self._byte_decoder = _byte_decoder() if tokenizer is not None and _is_byte_level(tokenizer) else None
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: t.content for i, t in decoder.items()}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                                            else f"token_id:{token_id}")
        return text

    def bytes(self, token_id: int) -> list[int] | None:
        if token_id not in self._bytes:
            self._bytes[token_id] = self._token_bytes(token_id)
        return self._bytes[token_id]

    def _token_bytes(self, token_id: int) -> list[int] | None:
        if self.tokenizer is None:
            return None
        if token_id in self._added:
            return list(self._added[token_id].encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_decoder is not None and all(ch in self._byte_decoder for ch in piece):
                return [self._byte_decoder[ch] for ch in piece]
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return [int(fallback.group(1), 16)]
        return list(self.text(token_id).encode("utf-8"))

    # -- OpenAI formats --------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                            offset: int) -> tuple[dict, int]:
        """The legacy completions format, and the text offset after these tokens. top_logprobs holds the
        top-N plus the sampled token (as OpenAI documents)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, logprobs):
            s = self.text(tid)
            tokens.append(s)
            token_lps.append(_finite(lp.get(tid)))
            top: dict[str, float] = {}
            for t, v in sorted(lp.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.text(t), _finite(v))  # tokens decoding alike (partial UTF-8): keep the first
            tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> dict:
        content = []
        for tid, lp in zip(token_ids, logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:num_top]
            content.append({**self._chat_token(tid, lp.get(tid)),
                            "top_logprobs": [self._chat_token(t, v) for t, v in top]})
        return {"content": content, "refusal": None}

    def _chat_token(self, token_id: int, logprob: float | None) -> dict:
        return {"token": self.text(token_id), "logprob": _finite(logprob), "bytes": self.bytes(token_id)}


__all__ = ["TokenTexts"]
