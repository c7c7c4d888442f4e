"""speculative_config: what a user may give (vLLM's names, a dict or its JSON text) and the checked, complete settings the
engine runs (SpeculativeConfig). A ground module beside config (no torch): the CLI and the API process check it.

n-gram and suffix drafts are a deterministic function of what is known (the request's tokens, recent requests'
outputs), i.e. one-hot draft distributions, so verification is exact by sampling the target at every draft position
and accepting while the sample equals the draft (runner/speculative.py says why that is rejection sampling); a draft
model's drafts are its greedy choices too, except for unseeded sampled requests, whose drafts it samples and the
sampler verifies against its distribution (runner/sampler.against_draft).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
NGRAM_DEFAULT_LOOKUP = 5  # prompt_lookup_min / _max when neither is given (vLLM's default)
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
MAX_SPECULATIVE_TOKENS = 32  # drafts per sequence per step: the verification rows of a step grow with it
# A sequence's acceptance starts from this prior (accepted, proposed) until its own drafts are counted.
ACCEPTANCE_PRIOR = (1.0, 2.0)
# ... and the chance its host proposer finds a draft at all from this prior (found, asked).
FOUND_PRIOR = (1.0, 1.0)
# Backed off, about this many sequences a step get a shadow draft (each in turn): the proposer's host time stays small
# at large batches, where backing off is the common case.
SHADOW_DRAFTS_PER_STEP = 4
# ... and a sequence gets one at most every this many steps, when the plan is also priced again unless a shadow draft
# settled or a sequence came or went: at small batches the host's own time a step is what backing off saves.
BACKED_OFF_TURNS = 4
# While the loop waits for the device, a host proposer indexes what waits this many tokens at a time, checking in
# between whether the step's tokens are ready (a suffix token costs ~5-10 µs a chunk's token on a CPU).
IDLE_INDEX_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: the shortest / longest suffix n-gram looked up in the context
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int | None = None  # suffix: the longest context matched (and pattern stored)
    suffix_decoding_max_cached_requests: int | None = None  # suffix: finished requests whose outputs are indexed
    suffix_decoding_max_spec_factor: float | None = None  # suffix: drafts ≤ factor × the matched length
    suffix_decoding_min_token_prob: float | None = None  # suffix: a draft token's least estimated probability
    model: str | None = None  # draft_model: the draft's folder, GGUF file or hub id (the target's tokenizer)
    adaptive: bool = True  # per step, the number of drafts (0 included) from the measured step-cost curves

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A dict, its JSON text or None (off) → the checked settings, defaults filled in; one-line ValueErrors."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(names)}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        return {"ngram": _ngram, "suffix": _suffix, "draft_model": _draft_model}[method](dict(value))

    @property
    def drafts_on_device(self) -> bool:
        """n-gram drafts (kernels/ngram.py) and a draft model's (runner/draft_model.py) are proposed on the device, so
        the asynchronous loop stays; suffix drafts (a tree over many requests) are proposed on the host, which must
        read each step first."""
        return self.method in ("ngram", "draft_model")

    @property
    def drafts_in_token_steps(self) -> bool:
        """A draft model also proposes for decode rows that ride in a token-count step beside prompts (the runner
        proposes before that step's forward); n-gram device drafts run as decode rows only."""
        return self.method == "draft_model"

    @property
    def samples_drafts(self) -> bool:
        """A draft model draws a sampled request's drafts from its own distribution (kept on the device for the
        rejection test); the other methods' drafts are deterministic."""
        return self.method == "draft_model"

    def as_dict(self) -> dict:
        """The settings the engine runs, without the other method's keys (what EngineConfig keeps)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _int_at_least(settings: dict, name: str, least: int, most: int | None = None) -> int:
    value = settings[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        bound = f"in [{least}, {most}]" if most is not None else f">= {least}"
        raise ValueError(f"speculative_config: {name} must be an integer {bound}, got {value!r}")
    return value


def _only(settings: dict, method: str, keys: tuple[str, ...]) -> None:
    foreign = sorted(k for k in settings if k not in keys + ("method", "num_speculative_tokens", "adaptive"))
    if foreign:
        raise ValueError(f"speculative_config: {foreign} do not apply to method {method!r}")


def _common(settings: dict) -> dict:
    _int_at_least(settings, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if not isinstance(settings.get("adaptive", True), bool):
        raise ValueError(f"speculative_config: adaptive must be true or false, got {settings['adaptive']!r}")
    return settings


def _ngram(s: dict) -> SpeculativeConfig:
    _only(s, "ngram", ("prompt_lookup_min", "prompt_lookup_max"))
    if "num_speculative_tokens" not in s:
        raise ValueError("speculative_config: method 'ngram' needs num_speculative_tokens")
    lo, hi = s.get("prompt_lookup_min"), s.get("prompt_lookup_max")
    s["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else NGRAM_DEFAULT_LOOKUP)
    s["prompt_lookup_max"] = hi if hi is not None else s["prompt_lookup_min"]
    lo = _int_at_least(s, "prompt_lookup_min", 1)
    hi = _int_at_least(s, "prompt_lookup_max", 1)
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
    return SpeculativeConfig(**_common(s))


def _draft_model(s: dict) -> SpeculativeConfig:
    _only(s, "draft_model", ("model",))
    if "num_speculative_tokens" not in s:
        raise ValueError("speculative_config: method 'draft_model' needs num_speculative_tokens")
    if not isinstance(s.get("model"), str) or not s["model"]:
        raise ValueError("speculative_config: method 'draft_model' needs \"model\": the draft model's folder, GGUF "
                         "file or hub id")
    return SpeculativeConfig(**_common(s))


def _suffix(s: dict) -> SpeculativeConfig:
    _only(s, "suffix", tuple(SUFFIX_DEFAULTS))
    s = SUFFIX_DEFAULTS | s
    depth = _int_at_least(s, "suffix_decoding_max_tree_depth", 1)
    s.setdefault("num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS))
    _int_at_least(s, "suffix_decoding_max_cached_requests", 0)
    factor, prob = s["suffix_decoding_max_spec_factor"], s["suffix_decoding_min_token_prob"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be > 0, got {factor!r}")
    if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
        raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")
    s["suffix_decoding_max_spec_factor"], s["suffix_decoding_min_token_prob"] = float(factor), float(prob)
    return SpeculativeConfig(**_common(s))


__all__ = ["SpeculativeConfig", "SPECULATIVE_METHODS", "MAX_SPECULATIVE_TOKENS", "ACCEPTANCE_PRIOR", "FOUND_PRIOR",
           "SHADOW_DRAFTS_PER_STEP", "BACKED_OFF_TURNS", "IDLE_INDEX_TOKENS"]
