"""Verifying drafts on the device: which sampled row's token becomes a sequence's last token.

A sequence that verifies d drafts runs its last token and the drafts in one step, and its d + 1 logit rows are each
sampled exactly as a lone decode row would be (same parameters; row j sees the drafts before it as its history).
Row j's draft is accepted when row j's sample equals it; the sequence keeps the samples of rows 0..a, where row a is
the first whose sample differs from its draft (the last row has none, so a ≤ d).

That is exact, greedy or not. Every proposer here drafts deterministically from what the host knows, so a draft is a
one-hot distribution q = δ(x). Rejection sampling accepts x with probability min(1, p(x) / q(x)) = p(x) and on
rejection draws from max(p − q, 0) normalized, which is p without x. Drawing y ~ p and accepting when y = x does both at
once: y = x with probability p(x), and a y ≠ x is distributed as p conditioned on not x. When every draft is accepted
the last row's sample is the bonus token, drawn from p as usual. Greedy is the temperature → 0 case of the same rule.
The host reads every row's sample and finds a itself (engine/core.py); the device only needs the new last token in the
slot's cell, for the next step's input — done here, without a sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyRows:
    """Per sampled row (views of the step's input buffer): the draft its sample must equal (-1 for a sequence's last
    row) and how many rows of its sequence come before it."""

    draft_ids: torch.Tensor  # [n] int32
    group_back: torch.Tensor  # [n] int32


def accepted_store_slots(tokens: torch.Tensor, verify: VerifyRows, slots: torch.Tensor, dummy_slot: int) -> torch.Tensor:
    """Per sampled row, the slot its token is stored in: its sequence's slot for the row that ends the accepted run
    (the first whose sample is not its draft), the dummy slot for every other row. Graph-capturable (no sync)."""
    miss = (tokens.to(torch.int32) != verify.draft_ids).to(torch.int32)
    before = torch.cumsum(miss, 0) - miss  # misses in the rows before each row
    first = torch.arange(len(miss), device=miss.device) - verify.group_back.long()  # its sequence's first row
    in_sequence = before - before[first]  # ... counted from there
    ends = (in_sequence == 0) & (miss == 1)
    return torch.where(ends, slots, torch.full_like(slots, dummy_slot))


def accepted_count(samples: list[int], drafts: list[int]) -> int:
    """The host's side of the same rule: how many leading drafts equal the samples at their positions."""
    a = 0
    while a < len(drafts) and samples[a] == drafts[a]:
        a += 1
    return a


__all__ = ["VerifyRows", "accepted_store_slots", "accepted_count"]
