"""A verification step's samples stored in one launch: each sequence's accepted run, its last token, its history.

Why: at b = 1 a small model's speculative loop is bound by the host, and the torch ops that found each sequence's
accepted run (a cumulative sum over misses) and stored its tokens cost ~35 launches a verify step. One program per
sampled row does it here, with no host read (graph-capturable).

Rows of one sequence are consecutive (group_back[r]: how many rows of its sequence precede row r); row r's sample is
checked against draft_ids[r] (-1: none, the sequence's last row; plain rows are all -1 with group_back 0). Row r is
kept when no row of its sequence before it missed its draft, and it ends its sequence's run when it is kept and misses
its own. The ending row's token goes to last_tokens[slot] (the next step's input); with histories (drafting on the
device, runner/speculative.DraftState) every kept row's token goes to history[slot, position + 1] and the ending row
sets hist_len[slot] = position + 2 (tokens known on the device). A row of slot pad_slot (a graph's padding) stores
nothing.
"""
from __future__ import annotations

import torch

from nanoserve.kernels._triton import jit, tl, use_triton


def _run(tokens: torch.Tensor, draft_ids: torch.Tensor, group_back: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, ends) per row, in torch ops (the reference's rule)."""
    miss = (tokens.to(torch.int32) != draft_ids).to(torch.int32)
    before = torch.cumsum(miss, 0) - miss  # misses in the rows before each row
    first = torch.arange(len(miss), device=miss.device) - group_back.long()  # its sequence's first row
    kept = (before - before[first]) == 0  # ... counted from there
    return kept, kept & (miss == 1)


def store_samples_ref(tokens: torch.Tensor, slots: torch.Tensor, last_tokens: torch.Tensor,
                      draft_ids: torch.Tensor | None = None, group_back: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, history: torch.Tensor | None = None,
                      hist_len: torch.Tensor | None = None, pad_slot: int = -1) -> None:
    """Plain PyTorch (the CPU path and the oracle); see store_samples."""
    if draft_ids is None:
        kept = ends = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    else:
        kept, ends = _run(tokens, draft_ids, group_back)
    real = slots != pad_slot
    kept, ends = kept & real, ends & real
    tokens = tokens.to(torch.int32)
    last_tokens[slots.long()[ends]] = tokens[ends]
    if history is not None:
        pos = positions.long() + 1
        col = pos.clamp(max=history.shape[1] - 1)
        history[slots.long()[kept], col[kept]] = tokens[kept]
        hist_len[slots.long()[ends]] = (pos + 1).to(torch.int32)[ends]


def store_samples(tokens: torch.Tensor, slots: torch.Tensor, last_tokens: torch.Tensor,
                  draft_ids: torch.Tensor | None = None, group_back: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None, history: torch.Tensor | None = None,
                  hist_len: torch.Tensor | None = None, pad_slot: int = -1) -> None:
    """The sampled rows' tokens [n] (any int dtype) into their slots (the module docstring gives the rule):
    draft_ids / group_back [n] int32 (None: plain rows, every one ends its sequence's run); with history [S, L] int32
    and hist_len [S] int32, positions [n] int32 (each row's input position) too; rows of slot pad_slot store nothing.
    No host read on CUDA."""
    if not use_triton(tokens):
        return store_samples_ref(tokens, slots, last_tokens, draft_ids, group_back, positions, history, hist_len,
                                 pad_slot)
    n = tokens.shape[0]
    if not n:
        return
    verify, record = draft_ids is not None, history is not None
    _store_samples_kernel[(n,)](
        tokens, slots, last_tokens, draft_ids if verify else slots, group_back if verify else slots,
        positions if record else slots, history if record else last_tokens, hist_len if record else last_tokens,
        history.stride(0) if record else 0, history.shape[1] if record else 1, pad_slot, VERIFY=verify,
        RECORD=record, num_warps=1)


@jit
def _store_samples_kernel(tokens_ptr, slots_ptr, last_ptr, drafts_ptr, back_ptr, pos_ptr, history_ptr, hist_len_ptr,
                          stride_history, max_len, pad_slot, VERIFY: tl.constexpr, RECORD: tl.constexpr):
    r = tl.program_id(0)
    token = tl.load(tokens_ptr + r).to(tl.int32)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    kept = slot != pad_slot  # (a padding row keeps and ends nothing; a scalar the loop below may carry)
    ends = kept
    if VERIFY:
        first = r - tl.load(back_ptr + r)
        for i in range(first, r):  # a row before it in its sequence missed its draft: this one is not kept
            kept = kept & (tl.load(tokens_ptr + i).to(tl.int32) == tl.load(drafts_ptr + i))
        ends = kept & (token != tl.load(drafts_ptr + r))
    if ends:
        tl.store(last_ptr + slot, token)
    if RECORD:
        pos = tl.load(pos_ptr + r) + 1
        if kept:
            tl.store(history_ptr + slot * stride_history + tl.minimum(pos, max_len - 1), token)
        if ends:
            tl.store(hist_len_ptr + slot, pos + 1)


__all__ = ["store_samples", "store_samples_ref"]
