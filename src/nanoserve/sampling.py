"""SamplingParams: how one request is sampled and when it stops (validated; vLLM's names and defaults).
The sampler that applies them on the device is runner/sampler.py."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from nanoserve.config import MAX_LOGPROBS
from nanoserve.errors import RequestError

GREEDY_EPS = 1e-5  # like vLLM: temperature below this means greedy
MAX_N = 128
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's bound); each bias is clamped to [-100, 100]
LOGIT_BIAS_LIMIT = 100.0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise RequestError.of_field(name, f"must be {allowed}, got {value!r}")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of a JSON schema (dict or its text), a
    regex, a list of choices, an EBNF grammar, or any JSON object. Enforced by xgrammar in the engine core."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON (json, json_object) is written compact by default, with json.dumps' separators ", " and ": " and no other
    # whitespace: a small model can otherwise fill max_tokens with newlines between tokens. vLLM's name; False allows
    # whitespace between tokens again, at most STRUCTURED_JSON_MAX_WHITESPACE characters at each place.
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", f"exactly one of {', '.join(STRUCTURED_KINDS)}",
               given or "none")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json",
               "a JSON schema (an object or its text)", self.json)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, str) and v), f"structured_outputs.{name}", "a non-empty string", v)
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice and
                                       all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", "a non-empty list of strings", self.choice)
        _check(self.json_object in (None, True, False), "structured_outputs.json_object", "a bool", self.json_object)
        _check(self.disable_any_whitespace in (None, True, False), "structured_outputs.disable_any_whitespace",
               "a bool", self.disable_any_whitespace)
        if self.choice is not None:
            self.choice = list(self.choice)
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise RequestError.of_field("structured_outputs.json",
                                            f"must be a JSON schema, and its text is not JSON: {e}") from None

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def json_whitespace(self) -> bool:
        """Whether JSON output may hold whitespace beyond the compact separators."""
        return self.disable_any_whitespace is False and self.kind in ("json", "json_object")

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, text, json_whitespace), the same for equal constraints (a schema as an object or as text, spaced any
        way; its key order is kept, as it orders the output's properties): compiled grammars are cached by it."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, separators=(",", ":"), ensure_ascii=False), self.json_whitespace
        if kind == "choice":
            return kind, json.dumps(self.choice, ensure_ascii=False), False
        return kind, "" if kind == "json_object" else getattr(self, kind), self.json_whitespace


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. Field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (normalised to 0)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per token; 0: only the sampled token's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id → added to its logit before sampling (OpenAI's)
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (top-k as logprobs; 0: the token's only)
    structured_outputs: StructuredOutputsParams | None = None  # output constrained by a grammar (xgrammar)

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", self.n)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0",
               self.temperature)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1 or 0 (off) or a positive integer", self.top_k)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]", self.min_p)
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed",
               "None or an integer in [-2**63, 2**64)", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               "None or an integer >= 1", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens={self.max_tokens}",
                   self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -2 <= v <= 2, name, "a number in [-2, 2]", v)
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf, "repetition_penalty",
               "a finite number > 0", self.repetition_penalty)
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and
                                                0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_KINDS) - {"disable_any_whitespace"})
            if unknown:
                raise RequestError.of_field("structured_outputs", f"has unknown fields {unknown}; it takes one of "
                                            f"{', '.join(STRUCTURED_KINDS)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))

        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _check(stop is None or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)),
               "stop", "None, a non-empty string or a list of non-empty strings", self.stop)
        self.stop = list(stop or [])
        ids = self.stop_token_ids
        _check(ids is None or (isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids)),
               "stop_token_ids", "None or a list of integers >= 0", ids)
        self.stop_token_ids = list(ids or [])
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        self.top_k = max(self.top_k, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def reached_min_tokens(self, num_output_tokens: int) -> bool:
        """min_tokens: an output of num_output_tokens tokens may end in a stop (EOS, stop_token_ids, a stop string).
        The sampler asks it of the tokens before the one it samples: stop tokens are banned until then."""
        return num_output_tokens >= self.min_tokens

    def make_generator(self, device: torch.device | str) -> torch.Generator | None:
        """Per-sequence RNG for seeded requests (the n completions of one request reach the core with seeds of their
        own: engine/output.py)."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed % 2**64)
        return g


def _logit_bias(bias) -> dict[int, float] | None:
    """At most MAX_LOGIT_BIAS token ids (>= 0) → numbers, clamped to [-100, 100] as OpenAI does; {} is None."""
    if bias is None or (isinstance(bias, dict) and not bias):
        return None
    _check(isinstance(bias, dict) and all(_is_int(t) and t >= 0 for t in bias) and
           all(_is_number(v) and math.isfinite(v) for v in bias.values()), "logit_bias",
           "a map of token ids (integers >= 0) to finite numbers", bias)
    _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens", f"{len(bias)} tokens")
    return {t: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(v))) for t, v in bias.items()}


__all__ = ["SamplingParams", "StructuredOutputsParams", "GREEDY_EPS", "MAX_LOGPROBS", "MAX_LOGIT_BIAS"]
