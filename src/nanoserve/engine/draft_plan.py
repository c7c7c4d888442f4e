"""How many drafts each sequence verifies this step: the plan that maximizes the expected tokens per millisecond.

A draft at position j (1-based) of a sequence whose drafts are accepted at rate α is kept only if every draft before
it is, so it is worth α^j expected tokens (the usual geometric model of acceptance). A step of b decoding rows that
verifies n drafts in all yields b + Σ α_i^j tokens and costs the measured time of a token-count step of b + n tokens;
with n = 0 it is a plain decode step (the batch-size curve). Candidates sorted by α_i^j give, for every n, the best n
drafts, and each sequence's chosen drafts stay a prefix of its own (α^j falls with j); the plan takes the n with the
most tokens per ms. So large batches (whose decode step is cheap per row) and sequences whose drafts are rarely
accepted verify few or none, and a single stream with a good acceptance rate verifies many.

A verification's decode rows cost less than as many plain rows: a sequence's rows read its context once (the
attention kernel takes them as one group), so the step's cost depends on its sequences as well as its rows
(VerifyCost: two measured curves, rows apart and rows grouped, and the step's sequences between them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanoserve.runner.startup.bucket_plan import StepTime
from nanoserve.speculative_config import ACCEPTANCE_PRIOR, FOUND_PRIOR


def acceptance_rate(accepted: int, drafted: int) -> float:
    """A sequence's running acceptance rate, from the prior until its own drafts are counted."""
    prior_accepted, prior_drafted = ACCEPTANCE_PRIOR
    return (accepted + prior_accepted) / (drafted + prior_drafted)


def found_rate(found: int, asked: int) -> float:
    """How often a sequence's host proposer finds a draft, from the prior until its own proposals are counted."""
    prior_found, prior_asked = FOUND_PRIOR
    return (found + prior_found) / (asked + prior_asked)


@dataclass(frozen=True)
class VerifyCost:
    """ms of a decode step that verifies drafts, by its rows and sequences, from two curves measured at start-up over
    the graphs a verification replays: apart (rows → ms, every row its own sequence: the plain probes; for a draft
    model its proposing graphs') and grouped (rows → ms, the rows in sequences of `group` = 1 + num_speculative_tokens
    rows, the last short). A step of s sequences over r rows is interpolated between them by s, linearly from
    r / group sequences (grouped) to r (apart): what grouping saves is the context reads, about one per sequence."""

    apart: StepTime
    grouped: StepTime | None = None
    group: int = 1

    def __call__(self, rows: np.ndarray, seqs: int) -> np.ndarray:
        apart = np.asarray(self.apart(rows), np.float64)
        if self.grouped is None or self.group <= 1:
            return apart
        r = np.asarray(rows, np.float64)
        fewest = np.ceil(r / self.group)  # the sequences of the grouped probe of as many rows
        share = np.clip((seqs - fewest) / np.maximum(r - fewest, 1.0), 0.0, 1.0)
        grouped = np.asarray(self.grouped(rows), np.float64)
        return grouped + share * (apart - grouped)


class StepCosts:
    """The plan's price list: ms of a step of b sequences that verifies n = 0..N drafts in all (decode_ms: rows → ms
    of a decode step; tokens_ms: tokens → ms of a token-count step; a step of up to max_decode_rows rows verifies as
    decode rows, a larger one as a token-count step; verify: what a decode step that verifies drafts costs,
    VerifyCost, None: as many plain rows). Depends on (b, N) only, so it is kept per (b, N): the plan runs every
    step, and at b = 1 the curve lookups cost more than the choice itself."""

    MAX_KEPT = 4096  # (b, N) price lists kept; beyond, the cache starts over

    def __init__(self, decode_ms: StepTime, tokens_ms: StepTime, max_decode_rows: int = 0,
                 verify: VerifyCost | None = None):
        self.decode_ms, self.tokens_ms, self.max_decode_rows, self.verify = decode_ms, tokens_ms, max_decode_rows, verify
        self._kept: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, b: int, n_max: int) -> np.ndarray:
        """[n_max + 1] ms: the step that verifies n drafts, n = 0..n_max (read-only: shared between steps)."""
        costs = self._kept.get((b, n_max))
        if costs is None:
            if len(self._kept) >= self.MAX_KEPT:
                self._kept.clear()
            costs = self._kept[b, n_max] = self._priced(b, n_max)
            costs.flags.writeable = False
        return costs

    def _priced(self, b: int, n_max: int) -> np.ndarray:
        n = np.arange(n_max + 1)
        rows = b + n
        as_decode = rows <= max(self.max_decode_rows, b)
        cost = np.asarray(self.tokens_ms(rows), np.float64).copy()
        cost[as_decode] = np.asarray(self.decode_ms(rows[as_decode]), np.float64)
        if self.verify is not None:
            drafting = as_decode & (n > 0)
            cost[drafting] = self.verify(rows[drafting], b)
        return cost


def plan_drafts(lengths: list[int], rates: list[float], decode_ms: StepTime, tokens_ms: StepTime,
                max_decode_rows: int = 0, verify: VerifyCost | None = None, host_ms: float | None = None,
                weights: list[float] | None = None) -> list[int]:
    """Per sequence, how many of its offered drafts (lengths[i]) to verify, given acceptance rates and the measured
    step times (StepCosts' arguments, priced for this step alone: the engine keeps a StepCosts and calls
    choose_drafts)."""
    costs = StepCosts(decode_ms, tokens_ms, max_decode_rows, verify)
    return choose_drafts(lengths, rates, costs(len(lengths), sum(lengths)), host_ms, weights)


def choose_drafts(lengths: list[int], rates: list[float], costs: np.ndarray, host_ms: float | None = None,
                  weights: list[float] | None = None) -> list[int]:
    """The plan at the price list costs (StepCosts(b, sum(lengths))). host_ms: the host's time a step, when drafting
    means waiting for it (host drafts need every token first): a plain step then costs max(device, host) (the loop
    overlaps them), a verifying one device + host. weights: per sequence, the chance its proposer finds a draft at
    all (each draft's worth is scaled by it)."""
    b = len(lengths)
    if not sum(lengths):
        return [0] * b
    if b == 1:
        prices = costs[:lengths[0] + 1].tolist()
        return [_single(lengths[0], rates[0], prices, 1.0 if weights is None else weights[0], host_ms)]
    if host_ms is not None:
        costs = costs.copy()
        costs[0] = max(costs[0], host_ms)
        costs[1:] += host_ms
    owner = np.repeat(np.arange(b), lengths)
    position = np.arange(len(owner)) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1
    value = np.asarray(rates, np.float64)[owner] ** position
    if weights is not None:
        value = value * np.asarray(weights, np.float64)[owner]
    order = np.lexsort((position, owner, -value))  # best first; ties: earlier sequence, earlier position
    expected = b + np.concatenate([[0.0], np.cumsum(value[order])])
    best = int(np.argmax(expected / costs))
    return np.bincount(owner[order[:best]], minlength=b).tolist()


def _single(length: int, rate: float, prices: list[float], weight: float, host_ms: float | None) -> int:
    """One sequence (a single stream, every step): its drafts in order of position (α^j falls with j), in plain
    Python over the price list (choose_drafts says what host_ms adds), where numpy's per-call set-up costs more than
    the arithmetic."""
    extra = 0.0 if host_ms is None else host_ms
    plain = prices[0] if host_ms is None else max(prices[0], host_ms)
    best_n, best, expected = 0, 1.0 / plain, 1.0
    for n in range(1, length + 1):
        expected += rate ** n * weight
        if expected / (prices[n] + extra) > best:
            best_n, best = n, expected / (prices[n] + extra)
    return best_n


__all__ = ["StepCosts", "VerifyCost", "acceptance_rate", "found_rate", "choose_drafts", "plan_drafts"]
