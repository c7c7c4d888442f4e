"""What the engine hands the runner each step: plain arrays, no engine objects.

Sequences live in fixed slots (rows of the persistent device state: block table, last sampled token).
A decode batch is one token per slot whose input id is the slot's last sampled token, read on the
device; a prefill batch carries prompt chunks (host token ids) and may carry decode rows too (token id
-1: read on the device). Block-table changes travel as updates (a decode row's one new block; a prefill
batch's (slot, column, block id) triples), so the device table is patched, never rebuilt.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.kernels.paging import blocks_for, kv_slots


def _empty(dtype=np.int32) -> np.ndarray:
    return np.zeros(0, dtype)


@dataclass
class BlockUpdates:
    """New block-table entries: block_table[slots[i], cols[i]] = block_ids[i]."""

    slots: np.ndarray = field(default_factory=_empty)
    cols: np.ndarray = field(default_factory=_empty)
    block_ids: np.ndarray = field(default_factory=_empty)

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class SamplingBatch:
    """One row per sampled sequence, in the order of its batch's sampled rows."""

    slots: np.ndarray  # [n] int32: the sampled token is stored in this slot for the next step's input
    temperature: np.ndarray  # [n] float32 (0: greedy)
    top_p: np.ndarray  # [n] float32
    top_k: np.ndarray  # [n] int32 (0: off)
    min_p: np.ndarray  # [n] float32
    generators: list[torch.Generator | None] | None = None  # per row, None when no row is seeded
    num_logprobs: list[int | None] | None = None  # per row, None when no row asks for logprobs
    banned_rows: np.ndarray = field(default_factory=_empty)  # min_tokens: these rows may not sample ...
    banned_tokens: np.ndarray = field(default_factory=_empty)  # ... these tokens (EOS, stop ids)
    penalties: "Penalties | None" = None
    bias_rows: np.ndarray = field(default_factory=_empty)  # logit_bias: logits[bias_rows[i], bias_tokens[i]] ...
    bias_tokens: np.ndarray = field(default_factory=_empty)
    bias_values: np.ndarray = field(default_factory=lambda: _empty(np.float32))  # ... += bias_values[i]
    grammar_rows: np.ndarray | None = None  # structured outputs: these rows may only sample what ...
    grammar_bitmask: torch.Tensor | None = None  # ... this [n, ceil(V / 32)] int32 xgrammar bitmask allows (host;
    # the other rows' masks allow every token)
    # a draft model's verification: per row, 1 when its draft was sampled from the draft's distribution q (kept on the
    # device: VerifyRows.q), so the row verifies it by rejection sampling against q; None: no such row
    draft_sampled: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def all_greedy(self) -> bool:
        return not (self.temperature > 0).any()

    @property
    def is_plain(self) -> bool:
        """Each row greedy or sampled at a temperature from the engine's noise, under a grammar's bitmask or not, and
        nothing else: no top-k, top-p, min-p, logprobs, bans, biases, penalties or seeded rows (the sampler's one
        kernel)."""
        return (self.generators is None and self.num_logprobs is None and self.penalties is None
                and self.draft_sampled is None
                and not len(self.banned_rows) and not len(self.bias_rows) and not (self.top_k > 0).any()
                and not (self.top_p < 1).any() and not (self.min_p > 0).any())

    @property
    def max_logprobs(self) -> int | None:
        """Top-k width of the step's logprobs (0: only the sampled token's), None when no row asks."""
        if self.num_logprobs is None:
            return None
        return max((k for k in self.num_logprobs if k is not None), default=None)


@dataclass
class Penalties:
    """Repetition / frequency / presence penalties need each row's token history (host lists)."""

    repetition: np.ndarray  # [n] float32
    frequency: np.ndarray
    presence: np.ndarray
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]


@dataclass
class DecodeBatch:
    """b decode rows (graph-replayable): row i runs slot slots[i]'s last sampled token."""

    slots: np.ndarray  # [b] int32
    positions: np.ndarray  # [b] int32: position of the input token
    slot_mapping: np.ndarray  # [b] int32: KV-cache slot (block * block_size + offset) of the input token
    context_lens: np.ndarray  # [b] int32: tokens in the cache after this step (positions + 1)
    new_block_cols: np.ndarray  # [b] int32: the column of the row's one new block in its slot's table, or -1
    new_block_ids: np.ndarray  # [b] int32
    sampling: SamplingBatch | None  # None: forward only (benchmarks)
    # verification (runner/speculative.py): sequences run as consecutive rows of their slot, their last token then
    # their drafts: each row's input id (-1: the slot's last sampled token), the draft its sample must equal (-1:
    # none) and its rows before it in the slot. None: plain decode rows.
    token_ids: np.ndarray | None = None
    draft_ids: np.ndarray | None = None
    group_back: np.ndarray | None = None
    # drafting on the device (runner/speculative.DraftState): per row 1 (its position from the device), and the slot
    # whose device drafts a sequence's first row proposes (-1: none); None: host positions, host drafts
    from_device: np.ndarray | None = None
    draft_slots: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.slots)


def disjoint_decode_batch(rows: int, context_len: int, block_size: int,
                          num_blocks: int) -> tuple[DecodeBatch, np.ndarray]:
    """A forward-only decode batch (sampling None) of `rows` rows in slots 0..rows-1, each one token after
    context_len - 1 cached ones, over disjoint blocks; and the block tables [rows, blocks per row] that the
    runner's PersistentState must hold for it (write_tables). The runner's start-up probes run it; so do the
    benchmarks that time one decode step (nanoserve/bench/decode_step.py). No request may be running."""
    per_row = blocks_for(context_len, block_size)
    if rows * per_row > num_blocks:
        raise ValueError(f"{rows} rows of {context_len} tokens do not fit in {num_blocks} KV blocks")
    slots = np.arange(rows, dtype=np.int32)
    tables = np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
    position = context_len - 1
    full = lambda v: np.full(rows, v, dtype=np.int32)  # noqa: E731
    batch = DecodeBatch(slots, full(position), kv_slots(tables, position, block_size), full(context_len), full(-1),
                        full(0), None)
    return batch, tables


def disjoint_verify_batch(rows: int, group: int, context_len: int, block_size: int,
                          num_blocks: int) -> tuple[DecodeBatch, np.ndarray]:
    """disjoint_decode_batch's rows as verifications: each run of `group` consecutive rows (the last run shorter) is
    one sequence in one slot, its last token then group - 1 drafts, the last row one token after context_len - 1
    cached ones; and the tables of slots 0..sequences-1. Forward only, like it (the start-up's verification probes)."""
    seqs = -(-rows // group)
    _, tables = disjoint_decode_batch(seqs, context_len, block_size, num_blocks)
    seq, back = np.divmod(np.arange(rows, dtype=np.int32), group)
    last = np.minimum((seq + 1) * group, rows) - 1
    positions = (context_len - 1 - (last - np.arange(rows))).astype(np.int32)
    token_ids = np.where(back == 0, -1, 0).astype(np.int32)  # the slot's last token, then drafts (any ids)
    draft_ids = np.where(np.arange(rows) == last, -1, 0).astype(np.int32)
    full = lambda v: np.full(rows, v, dtype=np.int32)  # noqa: E731
    batch = DecodeBatch(seq.astype(np.int32), positions, kv_slots(tables[seq].tolist(), positions, block_size),
                        positions + 1, full(-1), full(0), None, token_ids, draft_ids, back.astype(np.int32))
    return batch, tables


@dataclass
class PrefillBatch:
    """Chunks of s sequences (eager): sequence i runs query_lens[i] tokens from position starts[i]."""

    slots: np.ndarray  # [s] int32
    starts: np.ndarray  # [s] int32: tokens already in the cache
    query_lens: np.ndarray  # [s] int32
    token_ids: np.ndarray  # [T] int32; -1: the slot's last sampled token (a decode row riding along)
    slot_mapping: np.ndarray  # [T] int32
    block_updates: BlockUpdates
    sample_rows: np.ndarray  # [n] int32: the sequences (indices into slots) whose chunk ends with a sampled token
    sampling: SamplingBatch | None
    max_blocks: int  # widest block table among the s sequences (host-side bound for the attention metadata)
    prompt_logprob_rows: np.ndarray = field(default_factory=_empty)  # token rows whose next prompt token's ...
    prompt_logprob_targets: np.ndarray = field(default_factory=_empty)  # ... logprob is asked (these tokens)
    prompt_logprob_k: int = 0  # top logprobs per such row
    # speculative decoding: sampled sequence i samples its last sample_counts[i] token rows (its decode token and its
    # drafts), and each such row's sample is checked against draft_ids (the draft at the next position; -1 after
    # the last): None when no row verifies drafts (one sample per sampled sequence)
    sample_counts: np.ndarray | None = None
    draft_ids: np.ndarray | None = None
    # drafting on the device: the prompt tokens this step makes known (chunks and cached prefixes), for the slots'
    # device histories (empty otherwise)
    known_slots: np.ndarray = field(default_factory=_empty)
    known_positions: np.ndarray = field(default_factory=_empty)
    known_ids: np.ndarray = field(default_factory=_empty)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_cached_context(self) -> bool:
        """Some query attends to keys that only the paged cache holds (prefix hits, earlier chunks, decode rows)."""
        return bool((self.starts > 0).any())


@dataclass
class SampledTokens:
    """What the device sampled for a step's sampled rows, as read back from pinned memory."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampled token's logprob per row
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, its params.logprobs best pairs
    draft_ids: list[int] | None = None  # a verification's rows: the draft each row's sample was checked against
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per PrefillBatch.prompt_logprob_rows
