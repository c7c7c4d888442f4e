"""Prompts in, validated token ids out: the one place that normalises prompts (text, token ids, lists of
either) and checks them against the model's limits, for the offline LLM and the server alike."""
from __future__ import annotations

from collections.abc import Sequence

from nanoserve.errors import RequestError
from nanoserve.sampling import SamplingParams

Prompt = str | list[int]


class QueueFullError(RuntimeError):
    """Too many requests are already waiting (the server answers 503)."""


def check_queue(num_waiting: int, num_new: int, max_waiting_requests: int) -> None:
    """max_waiting_requests, for the offline engine and the server alike: RequestError when num_new sequences could
    never wait at once (split the request; param n), QueueFullError when they do not fit beside the
    num_waiting ones."""
    if num_new > max_waiting_requests:
        raise RequestError(f"The request needs {num_new} sequences (prompts × n), more than the waiting queue can "
                           f"ever hold (max_waiting_requests={max_waiting_requests}); split it.", param="n")
    if num_waiting + num_new > max_waiting_requests:
        raise QueueFullError(f"{num_waiting} sequences are already waiting "
                             f"(max_waiting_requests={max_waiting_requests})")


def is_token_ids(value) -> bool:
    """A list or tuple of plain ints (not bools). Set of types, not a per-item isinstance loop: this runs on every
    prompt, and a 1024-token one took ~0.4 ms that way."""
    return isinstance(value, (list, tuple)) and set(map(type, value)) <= {int}


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A string, a list of token ids, or a list of those → a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and is_token_ids(prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return [p if isinstance(p, str) else list(p) if is_token_ids(p) else _bad(p) for p in prompts]
    return _bad(prompts)


def _bad(prompt):
    raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt")


def tokenize(tokenizer, prompt: Prompt, vocab_size: int, max_model_len: int,
             add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids), or RequestError (param "prompt"): empty, no room to generate, ids outside
    the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this engine was started with skip_tokenizer_init: give prompts as token ids",
                               param="prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        check_prompt_length(len(ids), max_model_len)
        return prompt, ids
    if not is_token_ids(prompt):
        _bad(prompt)
    ids = list(prompt)
    check_prompt_ids(ids, vocab_size, max_model_len)
    return None, ids


def check_prompt_ids(ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """The one check of a token-id prompt, for every front end and the core: RequestError (param "prompt") for an
    empty prompt or one without room to generate, then for an id outside the vocabulary (cheapest first: the
    length before looking at every id)."""
    check_prompt_length(len(ids), max_model_len)
    check_token_ids(ids, vocab_size)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """RequestError naming the first id outside [0, vocab_size) (min / max first: they run in C); `param`: the field
    the ids came from (named in the message unless it is the prompt)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        where = "" if param == "prompt" else f"{param}: "
        raise RequestError(f"{where}token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def check_params_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """SamplingParams' token ids (stop_token_ids, logit_bias' keys) within the vocabulary."""
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias or ()), vocab_size, "logit_bias")


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """RequestError for an empty prompt or one that leaves no room to generate."""
    if not num_tokens:
        raise RequestError("the prompt is empty", param="prompt")
    if num_tokens >= max_model_len:
        raise RequestError(f"the prompt has {num_tokens} tokens; max_model_len is {max_model_len} "
                           "(the prompt must leave room for at least one generated token)", param="prompt")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The server's rule (vLLM's): prompt + max_tokens must fit max_model_len."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.", param="max_tokens")
