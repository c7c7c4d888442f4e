"""`echo` on /v1/completions, as vLLM does it: each choice starts with its prompt's text; with `logprobs`, its
logprobs start with the prompt tokens' (the first token's is null: nothing precedes it), computed by the
engine as `prompt_logprobs`. `echo` with `max_tokens: 0` returns the prompt alone (scoring a text, as
evaluation harnesses do): one token is generated and dropped.
"""
from __future__ import annotations

from collections.abc import Callable

from nanoserve.server.logprobs import TokenTexts


def echo_choices(choice: Callable, collector, prompts: list[tuple[str | None, list[int]]], n: int,
                 token_texts: TokenTexts, want_logprobs: bool, echo_only: bool) -> Callable:
    """Wraps a completion choice builder: the first chunk of each choice gets its prompt in front."""
    texts = [text if text is not None else token_texts.tokenizer.decode(ids) for text, ids in prompts]
    started: set[int] = set()

    def echoed(index: int, c) -> dict:
        item = choice(index, c)
        prompt_index = index // n
        prompt_text = texts[prompt_index]
        lp = item["logprobs"]
        if echo_only:
            item["text"] = ""
            lp = item["logprobs"] = {k: [] for k in lp} if lp is not None else None
        if lp is not None:  # the completion's offsets follow the prompt's text
            lp["text_offset"] = [o + len(prompt_text) for o in lp["text_offset"]]
        if index in started:
            return item
        started.add(index)
        item["text"] = prompt_text + item["text"]
        if lp is not None:
            head = _prompt_logprobs(token_texts, prompts[prompt_index][1], collector.prompt_logprobs.get(prompt_index))
            item["logprobs"] = {k: head[k] + lp[k] for k in lp}
        return item
    return echoed


def _prompt_logprobs(token_texts: TokenTexts, ids: list[int], entries: list | None) -> dict:
    """The prompt's part of a legacy logprobs object: null for the first token (and for all, if missing)."""
    entries = entries or [None] * len(ids)
    first = token_texts.text(ids[0])
    rest, _ = token_texts.completion_logprobs(ids[1:], [e or {} for e in entries[1:]], len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}
