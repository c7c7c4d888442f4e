"""SamplingParams (validated, vLLM names and defaults) and the batched Sampler.

The Sampler works on the whole batch at once on the logits' device: per-row parameters become
[N] tensors, and the step ends with a single device→host transfer. Seeded rows draw their noise
from their own generator, so a seeded request gives the same tokens whatever else is batched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

GREEDY_EPS = 1e-5  # like vLLM: temperature below this means greedy
MAX_LOGPROBS = 20
MAX_N = 128


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


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

    @property
    def max_stop_len(self) -> int:
        """Longest stop string: streamed text keeps back this many chars minus one until it cannot match."""
        return max((len(s) for s in self.stop), default=0)

    def make_generator(self, device: torch.device | str, index: int = 0) -> torch.Generator | None:
        """Per-sequence RNG for seeded requests; completion `index` of n uses seed + index (as vLLM does)."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed((self.seed + index) % 2**64)
        return g


class SeqLike(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None  # sampled token's logprob per row; None when no row asked
    top_logprobs: list[list[tuple[int, float]]] | None = field(default=None)  # per row, params.logprobs pairs


class Sampler:
    """logits [N, V] + the N sequences → one token per row (plus logprobs when asked)."""

    def __call__(self, logits: torch.Tensor, seqs: list[SeqLike], eos_token_ids: list[int]) -> SamplerOutput:
        params = [s.params for s in seqs]
        if len(params) != logits.shape[0]:
            raise ValueError(f"got {logits.shape[0]} logit rows for {len(params)} sequences")
        num_lp = [p.logprobs for p in params]
        want_lp = any(k is not None for k in num_lp)
        pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        min_rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        all_greedy = all(p.greedy for p in params)
        if all_greedy and not (want_lp or pen_rows or min_rows):
            return SamplerOutput(logits.argmax(dim=-1).tolist())

        logits = logits.clone() if logits.dtype == torch.float32 else logits.float()  # masked in place below
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
        if min_rows:
            _block_stop_tokens(logits, seqs, min_rows, eos_token_ids)
        if pen_rows:
            _apply_penalties(logits, seqs, pen_rows)
        tokens = logits.argmax(dim=-1) if any(p.greedy for p in params) else None
        if not all_greedy:
            sampled = _sample(logits, seqs)
            if tokens is None:
                tokens = sampled
            else:
                greedy = torch.tensor([p.greedy for p in params], device=logits.device)
                tokens = torch.where(greedy, tokens, sampled)
        if not want_lp:
            return SamplerOutput(tokens.tolist())

        # pack tokens, sampled logprobs and the top-K pairs into one float64 tensor: one transfer
        k = min(max(v or 0 for v in num_lp), logits.shape[1])
        cols = [tokens.double()[:, None], raw_logprobs.gather(1, tokens[:, None]).double()]
        if k:
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
            cols += [top_ids.double(), top_vals.double()]
        rows = torch.cat(cols, dim=1).tolist()
        top = [[(int(r[2 + j]), r[2 + k + j]) for j in range(min(n or 0, k))] for r, n in zip(rows, num_lp)]
        return SamplerOutput([int(r[0]) for r in rows], [r[1] for r in rows], top)


def _block_stop_tokens(logits: torch.Tensor, seqs, rows: list[int], eos_token_ids: list[int]) -> None:
    """min_tokens: rows that are still short may not sample EOS or their stop_token_ids."""
    vocab = logits.shape[1]
    r, c = [], []
    for i in rows:
        p = seqs[i].params
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned = [t for t in banned if t < vocab]
        r += [i] * len(banned)
        c += banned
    if r:
        logits[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = -math.inf


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts; lists are padded with `vocab`, a column that is dropped."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        ids = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, seqs, rows: list[int]) -> None:
    """Repetition penalty over prompt+output tokens, presence/frequency penalties over output tokens."""
    vocab, device = logits.shape[1], logits.device
    idx = torch.tensor(rows, device=device)
    params = [seqs[i].params for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    out_counts = _token_counts([seqs[i].output_token_ids for i in rows], vocab, device)
    seen = (_token_counts([seqs[i].prompt_token_ids for i in rows], vocab, device) > 0) | (out_counts > 0)
    x = logits[idx]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * out_counts - pres * (out_counts > 0).float()
    logits[idx] = x


def _sample(logits: torch.Tensor, seqs) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race (argmax of probs / E, E ~ Exp(1))."""
    params = [s.params for s in seqs]
    n, vocab = logits.shape
    device = logits.device
    temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    logits = logits / temp[:, None]

    use_top_k = any(0 < p.top_k < vocab for p in params)
    use_top_p = any(p.top_p < 1 for p in params)
    if use_top_k or use_top_p:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        if use_top_k:  # keep logits >= the k-th largest (ties at the boundary are kept)
            k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, -math.inf)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
        if use_top_p:  # keep the smallest prefix whose mass reaches top_p (at least one token)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            keep = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)
            keep = torch.where(top_p < 1, keep, vocab)
            threshold = sorted_logits.gather(1, (keep - 1)[:, None])
            logits = logits.masked_fill(logits < threshold, -math.inf)
    if any(p.min_p > 0 for p in params):  # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device)
        floor = logits.max(dim=-1, keepdim=True).values + log_min_p[:, None]
        logits = logits.masked_fill(logits < floor, -math.inf)

    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, s in enumerate(seqs):
        if s.generator is not None and not s.params.greedy:
            noise[i].exponential_(generator=s.generator)
    return probs.div_(noise.clamp_min_(1e-10)).argmax(dim=-1)


__all__ = ["SamplingParams", "Sampler", "SamplerOutput", "GREEDY_EPS", "MAX_LOGPROBS"]
