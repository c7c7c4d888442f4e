"""Incremental detokenization and stop-string handling.

Decoding only a short window of tokens per step keeps the cost flat in sequence length; text is
released only once it is final: a trailing incomplete UTF-8 character ("\ufffd") waits for the
next token, and a tail that could still become a stop string is held back until it cannot.
"""
from __future__ import annotations

from nanoserve.engine.sequence import Sequence

PROMPT_WINDOW = 5  # prompt tokens decoded with the first output tokens, so leading spaces come out right


def init_offsets(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - PROMPT_WINDOW, 0)
    seq.read_offset = seq.num_prompt_tokens


def append_text(tokenizer, seq: Sequence) -> None:
    """Extend seq.text with whatever the newest token makes final."""
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def flush_text(tokenizer, seq: Sequence) -> None:
    """At the end, release what was held back for completion (even a trailing incomplete character)."""
    ids, skip = seq.token_ids, seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    seq.text += full[len(prefix):]
    seq.prefix_offset = seq.read_offset = len(ids)


def find_stop_string(seq: Sequence, num_new_chars: int) -> str | None:
    """If a stop string now appears in seq.text, cut the text there and return it."""
    stops = seq.params.stop
    if not stops or num_new_chars == 0:
        return None
    longest = max(len(s) for s in stops)
    search_from = max(len(seq.text) - num_new_chars - longest + 1, 0)
    best: tuple[int, str] | None = None
    for stop in stops:
        at = seq.text.find(stop, search_from)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    seq.text = seq.text[:at + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:at]
    return stop


def visible_text(seq: Sequence) -> str:
    """The text that is final: while running, a tail that could begin a stop string is withheld."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    text, hold = seq.text, 0
    for stop in seq.params.stop:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[:len(text) - hold]
