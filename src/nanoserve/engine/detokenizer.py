"""Incremental detokenization (front end): token ids in, text that is final out.

Fast tokenizers use the tokenizers library's DecodeStream (constant work per token, holds back
incomplete UTF-8); others decode a short window per token. Both are primed with the last prompt tokens,
so the first output token's leading space comes out as a full decode would give it. `full_text` decodes
everything once (at the end, or for requests that are reported only when finished): streamed text is
always a prefix of it.
"""
from __future__ import annotations

PROMPT_WINDOW = 5  # prompt tokens decoded with the output, so leading spaces come out right


def full_text(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool) -> str:
    tail = prompt_ids[-PROMPT_WINDOW:]
    prefix = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(tail + output_ids, skip_special_tokens=skip_special_tokens)[len(prefix):]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = _decode_stream(backend, prompt_ids[-PROMPT_WINDOW:], skip_special_tokens)
        self._backend = backend
        self._ids = list(prompt_ids[-PROMPT_WINDOW:])  # window fallback state
        self._prefix_offset, self._read_offset = 0, len(self._ids)

    def push(self, token_id: int) -> str:
        """The text that token_id makes final ("" while a character is incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        ids, skip = self._ids, self.skip
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix):]


def _decode_stream(backend, prompt_tail: list[int], skip_special_tokens: bool):
    """A DecodeStream primed with the prompt's tail, or None (slow tokenizer, old tokenizers library)."""
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    try:
        return DecodeStream(ids=prompt_tail, skip_special_tokens=skip_special_tokens)
    except TypeError:  # a tokenizers version without `ids`: prime by stepping through the tail
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for t in prompt_tail:
            stream.step(backend, t)
        return stream

