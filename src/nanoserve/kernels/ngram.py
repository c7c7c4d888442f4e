"""The n-gram (prompt lookup) draft proposer on the device: every row's drafts from a device buffer of token histories.

Why: the host proposer (engine/drafts.py, NgramProposer) needs each step's sampled tokens on the host before it
drafts the next step, which keeps the speculative loop synchronous. Here the history of each running sequence lives
in a device buffer [slots, L] and one launch writes every row's drafts, with no host read: the step's inputs stay on
the device and the call can be captured in a CUDA graph (the caller gives fixed-size outputs through `out=`).

Semantics (NgramProposer._propose's, exactly): with size = lengths[slot] and tokens = history[slot, :size], for n
from min(lookup_max, size - 1) down to lookup_min, the latest start in [n, size - 1] with
tokens[start - n:start] == tokens[size - n:size] (an earlier occurrence: the suffix itself, start = size, never
counts) gives the drafts tokens[start:min(start + k, size)]; the longest n that matches wins; no match, no drafts.

The kernel's form of it: for a candidate start s ≤ size - 1, m(s) = how many tokens before s equal the suffix,
read backwards from s - 1 and from size - 1 (at most lookup_max, and at most s: nothing precedes position 0). Start s
matches for n exactly when m(s) ≥ n, and m(s) ≤ s ≤ size - 1 keeps n within the loop's bound by itself, so the
answer is the lexicographic maximum of (m(s), s) over the s with m(s) ≥ lookup_min: one max-reduction of a packed
key. One
program per row scans its history in tiles of BLOCK starts from the end backwards (repeats are usually recent) and
stops once m reaches its cap min(lookup_max, size - 1), which no earlier start can beat.
"""
from __future__ import annotations

import torch

from nanoserve.kernels._triton import HAS_TRITON, jit, next_power_of_2, tl, use_triton

BLOCK = 1024  # candidate starts per tile (4 warps: 8 a thread); a tile's shifted windows overlap in L1
NUM_WARPS = 4
# key = m << 32 | start: the longest match first, then the latest start (a constexpr: the kernel reads it)
_KEY_SHIFT = tl.constexpr(32) if HAS_TRITON else 32


def _check(history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, k: int, lookup_min: int,
           lookup_max: int) -> None:
    """One-line errors for what the kernel cannot take (shapes and dtypes only: nothing here reads the device)."""
    if not 1 <= lookup_min <= lookup_max:
        raise ValueError(f"ngram: need 1 <= lookup_min <= lookup_max, got {lookup_min}, {lookup_max}")
    if k < 1:
        raise ValueError(f"ngram: need k >= 1 drafts, got {k}")
    if history.dim() != 2 or history.dtype != torch.int32 or history.stride(1) != 1:
        raise ValueError(f"ngram: history must be an int32 [slots, L] tensor with contiguous rows, got "
                         f"{history.dtype} {list(history.shape)} strides {history.stride()}")
    for name, t in (("lengths", lengths), ("rows", rows)):
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != history.device:
            raise ValueError(f"ngram: {name} must be an int32 1-D tensor on {history.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")


def _outputs(rows: torch.Tensor, k: int, out: tuple[torch.Tensor, torch.Tensor] | None):
    """The caller's (drafts [R, k], counts [R]) int32 buffers, checked, or new ones."""
    num_rows = rows.shape[0]
    if out is None:
        return (torch.empty(num_rows, k, dtype=torch.int32, device=rows.device),
                torch.empty(num_rows, dtype=torch.int32, device=rows.device))
    drafts, counts = out
    if (drafts.shape != (num_rows, k) or counts.shape != (num_rows,) or drafts.dtype != torch.int32
            or counts.dtype != torch.int32 or not drafts.is_contiguous() or not counts.is_contiguous()):
        raise ValueError(f"ngram: out must be contiguous int32 drafts [{num_rows}, {k}] and counts [{num_rows}], "
                         f"got {drafts.dtype} {list(drafts.shape)} and {counts.dtype} {list(counts.shape)}")
    return drafts, counts


def _propose_row_ref(tokens: torch.Tensor, k: int, lookup_min: int, lookup_max: int) -> torch.Tensor:
    """One history's drafts (a 1-D tensor, empty when nothing matches), the loop over n as NgramProposer runs it."""
    size = tokens.shape[0]
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        windows = tokens.unfold(0, n, 1)[:-1]  # window i is tokens[i:i + n], start i + n in [n, size - 1]
        hits = (windows == tokens[size - n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


def propose_ngram_ref(history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, k: int, lookup_min: int,
                      lookup_max: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch, a row at a time (the CPU path and the oracle; it reads the device): see propose_ngram."""
    _check(history, lengths, rows, k, lookup_min, lookup_max)
    drafts, counts = _outputs(rows, k, out)
    drafts.fill_(-1)
    for r, slot in enumerate(rows.tolist()):
        found = _propose_row_ref(history[slot, :int(lengths[slot])], k, lookup_min, lookup_max)
        drafts[r, :found.shape[0]] = found
        counts[r] = found.shape[0]
    return drafts, counts


def propose_ngram(history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, k: int, lookup_min: int,
                  lookup_max: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to k drafts for each slot of rows (the module docstring gives the rule): history [S, L] int32 (each slot's
    prompt + outputs), lengths [S] int32 (each slot's valid tokens, ≤ L: the last one included), rows [R] int32 (the
    slots to draft for, any order, R may be 0) → drafts [R, k] int32 (-1 past the count) and counts [R] int32.
    out: the caller's (drafts, counts) buffers, for a CUDA graph. No host read on CUDA; a padded row can point at a
    slot whose length is 0 (count 0)."""
    _check(history, lengths, rows, k, lookup_min, lookup_max)
    if not use_triton(history):
        return propose_ngram_ref(history, lengths, rows, k, lookup_min, lookup_max, out)
    drafts, counts = _outputs(rows, k, out)
    if rows.shape[0]:
        _ngram_kernel[(rows.shape[0],)](history, lengths, rows, drafts, counts, history.stride(0), K=k,
                                        K_BLOCK=next_power_of_2(k), LOOKUP_MIN=lookup_min, LOOKUP_MAX=lookup_max,
                                        BLOCK=BLOCK, num_warps=NUM_WARPS)
    return drafts, counts


@jit
def _ngram_kernel(history_ptr, lengths_ptr, rows_ptr, drafts_ptr, counts_ptr, stride_history, K: tl.constexpr,
                  K_BLOCK: tl.constexpr, LOOKUP_MIN: tl.constexpr, LOOKUP_MAX: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    slot = tl.load(rows_ptr + r)
    size = tl.load(lengths_ptr + slot)
    base = history_ptr + slot.to(tl.int64) * stride_history
    cap = tl.minimum(size - 1, LOOKUP_MAX)  # no start can match more
    best = tl.full((), -1, tl.int64)  # the packed (m, start) of the best start so far; -1: none
    hi = size - 1  # the latest start of the next tile
    while (hi >= LOOKUP_MIN) & ((best >> _KEY_SHIFT) < cap):
        starts = hi - tl.arange(0, BLOCK)
        run = starts >= LOOKUP_MIN  # m(s) <= s: earlier starts never match
        m = tl.zeros((BLOCK,), tl.int32)
        for j in tl.static_range(LOOKUP_MAX):  # compare the j-th token back from each start and from the end
            pos = starts - 1 - j
            run = run & (pos >= 0)
            want = tl.load(base + size - 1 - j, mask=size - 1 - j >= 0, other=0)  # (> pos wherever it is used)
            run = run & (tl.load(base + pos, mask=run, other=0) == want)
            m += run.to(tl.int32)
        keys = tl.where(m >= LOOKUP_MIN, (m.to(tl.int64) << _KEY_SHIFT) | starts.to(tl.int64), -1)
        best = tl.maximum(best, tl.max(keys, axis=0))
        hi -= BLOCK
    found = best >= 0
    start = tl.where(found, best - ((best >> _KEY_SHIFT) << _KEY_SHIFT), 0).to(tl.int32)
    count = tl.where(found, tl.minimum(size - start, K), 0)
    i = tl.arange(0, K_BLOCK)
    vals = tl.load(base + start + i, mask=i < count, other=-1)
    tl.store(drafts_ptr + r.to(tl.int64) * K + i, vals, mask=i < K)
    tl.store(counts_ptr + r, count)


__all__ = ["propose_ngram", "propose_ngram_ref"]
