"""Verifying drafts on the device: which sampled row's token becomes a sequence's last token.

A sequence that verifies d drafts runs its last token and the drafts in one step, and its d + 1 logit rows are each
sampled exactly as a lone decode row would be (same parameters; row j sees the drafts before it as its history).
Row j's draft is accepted when row j's sample equals it; the sequence keeps the samples of rows 0..a, where row a is
the first whose sample differs from its draft (the last row has none, so a ≤ d).

That is exact, greedy or not, for a draft that is a deterministic function of the context, a one-hot distribution
q = δ(x): n-gram, suffix, and a draft model's greedy drafts (its sampled drafts verify against their q instead:
runner/sampler.against_draft, with the same kept-run rule). Rejection sampling accepts x with probability min(1, p(x) / q(x)) = p(x) and on
rejection draws from max(p − q, 0) normalized, which is p without x. Drawing y ~ p and accepting when y = x does both at
once: y = x with probability p(x), and a y ≠ x is distributed as p conditioned on not x. When every draft is accepted
the last row's sample is the bonus token, drawn from p as usual. Greedy is the temperature → 0 case of the same rule.
The host reads every row's sample and finds a itself (engine/core.py); the device only needs the new last token in the
slot's cell, for the next step's input — done here, without a sync.

Drafting on the device (n-gram: DraftState) keeps the asynchronous loop: the host schedules step N+1 before it knows how
many drafts step N accepted. So each slot's tokens live on the device too (history, hist_len: written here from every
sampled row and from every prompt token a step makes known), the decode rows take their positions from hist_len and
their drafts from kernels/ngram.propose_ngram (kernels/step_inputs.py resolves both), and the host learns the drafts
with the samples (the verify rows' draft ids travel back with them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.kernels.ngram import propose_ngram
from nanoserve.kernels.step_inputs import DEVICE_DRAFT
from nanoserve.kernels.verify import store_samples


@dataclass
class VerifyRows:
    """Per sampled row (views of the step's input buffer): the draft its sample must equal (-1 for a sequence's last
    row) and how many rows of its sequence come before it."""

    draft_ids: torch.Tensor  # [n] int32
    group_back: torch.Tensor  # [n] int32
    q: torch.Tensor | None = None  # [n, vocab] float32: a sampled draft's distribution at the row that checks it
    sampled: torch.Tensor | None = None  # [n] int32: 1 where the row's draft was sampled from q


class DraftState:
    """The device's side of drafting on the device: each slot's tokens (prompt and kept samples) and their count, and
    the proposer's output for a decode bucket's rows. Row `trash` of history takes the writes of rows whose token is
    not kept; the dummy slot's count stays 0, so a padded row proposes nothing."""

    def __init__(self, num_slots: int, max_len: int, max_rows: int, block_size: int, k: int, lookup_min: int | None,
                 lookup_max: int | None, device: torch.device, history: bool = True):
        """num_slots: the slots with the dummy one (the last); max_len: max_model_len; max_rows: the largest decode
        batch; k: num_speculative_tokens. history=False (a draft model proposes): only the counts are kept (the
        token histories, which only the n-gram proposer reads, shrink to one column the stores clamp into)."""
        self.dummy, self.trash, self.block_size = num_slots - 1, num_slots, block_size
        self.k, self.lookup, self.keeps_history = k, (lookup_min, lookup_max), history
        self.history = torch.zeros(num_slots + 1, max_len if history else 1, dtype=torch.int32, device=device)
        self.hist_len = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        self.drafts = torch.full((max_rows, k), -1, dtype=torch.int32, device=device)
        self.counts = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def propose(self, draft_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for the rows of a bucket (draft_slots[r]: the slot of a sequence's first row when it verifies device
        drafts, else -1: the dummy slot, which proposes nothing): views of the static buffers, graph-capturable."""
        rows = draft_slots.shape[0]
        out = (self.drafts[:rows], self.counts[:rows])
        slots = torch.where(draft_slots >= 0, draft_slots, self.dummy)
        return propose_ngram(self.history, self.hist_len, slots, self.k, *self.lookup, out=out)

    def record_samples(self, tokens: torch.Tensor, verify: VerifyRows | None, slots: torch.Tensor,
                       positions: torch.Tensor, last_tokens: torch.Tensor) -> None:
        """The sampled rows' ending tokens into last_tokens and their kept tokens into their slots' histories (one
        launch: kernels/verify.py). Graph-capturable."""
        drafts, back = (None, None) if verify is None else (verify.draft_ids, verify.group_back)
        store_samples(tokens, slots, last_tokens, drafts, back, positions, self.history, self.hist_len)

    def record_known(self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """Prompt tokens a step makes known (its chunks' and cached prefixes' ids at their positions)."""
        if ids.shape[0] and self.keeps_history:
            self.history.index_put_((slots.long(), positions.long()), ids)


def accepted_count(samples: list[int], drafts: list[int]) -> int:
    """The host's side of the same rule: how many leading drafts equal the samples at their positions."""
    a = 0
    while a < len(drafts) and samples[a] == drafts[a]:
        a += 1
    return a


__all__ = ["DEVICE_DRAFT", "VerifyRows", "DraftState", "accepted_count"]
