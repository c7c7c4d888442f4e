"""Device-resident step state and the one host→device copy of each step's inputs, as typed records.

PersistentState: per slot (a running sequence's fixed row) its block table and its last sampled token,
both on the device; steps patch them, never rebuild them. Row max_num_seqs is the dummy slot that padded
rows use: its block table points every entry at the reserved dummy block.

A step's inputs are records of named views over one flat int32 buffer (floats stored as their bits), filled in a
pinned host mirror (two, alternating, so the host never waits for the previous copy) and moved with ONE copy.
Each record is a dataclass whose fields declare their region (`region`: its length in rows, tokens, sequences or
work-list entries, its pad value, its dtype); the layout is read from the fields, so a new step input (a KV scale,
draft tokens, an expert map) is one line in its record, and no code slices the buffer by position.

DecodeInputs: the static buffer the batch-size graphs read (DecodeViews), allocated once for max_num_seqs; a bucket
of B rows reads the regions of a prefix laid out for B. Padded rows get the dummy slot, the dummy KV slot and no
new block.

TokenInputs: the static buffer the token-count graphs read: TokenViews laid out for T tokens, then the step's
variable-length arrays (StepTail: sampled rows, block-table updates, prompt-logprob rows, sampling parameters),
which only eager work after the replay reads. Padded tokens run the dummy slot's token into the dummy KV slot;
padded sequences are empty; unused work entries are -1.

StepPacker: the same records at their own lengths for eager prompt / mixed steps (one copy too).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from nanoserve.kernels.attention import prefill_work, prefill_work_capacity
from nanoserve.kernels.kv_quant import tail_row
from nanoserve.runner.batch import DecodeBatch, PrefillBatch, SamplingBatch
from nanoserve.runner.sampler import SamplingTensors

# Region lengths: a static record's fields are laid out for a size (rows of a decode bucket, tokens of a token-count
# graph); a field without a length kind has its array's own length (eager steps, the variable tail).
ROWS, TOKENS, SEQS, SEQS_PLUS_1, WORK = "rows", "tokens", "seqs", "seqs+1", "work"
DUMMY_SLOT, DUMMY_KV_SLOT, TOTAL = "dummy_slot", "dummy_kv_slot", "total"  # pads known only at run time

ALIGN_WORDS = 4  # every region starts 16-byte aligned: Triton specializes kernels on pointer alignment, so
# regions at arbitrary offsets would compile a new variant of a kernel whenever a step meets a new alignment mix


def region(length: str | None = None, pad: Any = 0, dtype=np.int32):
    """A record field: a region of `length` (a kind above, or the array's own), padded with `pad`."""
    return dataclasses.field(default=None, metadata={"length": length, "pad": pad, "dtype": np.dtype(dtype)})


@dataclass
class DecodeViews:
    """A decode bucket's inputs (what the batch-size graphs read)."""

    slots: torch.Tensor = region(ROWS, DUMMY_SLOT)
    positions: torch.Tensor = region(ROWS, 0)
    slot_mapping: torch.Tensor = region(ROWS, DUMMY_KV_SLOT)
    context_lens: torch.Tensor = region(ROWS, 1)
    new_block_cols: torch.Tensor = region(ROWS, -1)  # the column of the row's one new block, or -1
    new_block_ids: torch.Tensor = region(ROWS, 0)
    # verification rows (a sequence's last token and its drafts, consecutive rows of its slot): the row's input id
    # (-1: the slot's last sampled token), the draft its sample must equal (-1: none), its rows before it in the slot
    token_ids: torch.Tensor = region(ROWS, -1)
    draft_ids: torch.Tensor = region(ROWS, -1)
    group_back: torch.Tensor = region(ROWS, 0)
    # drafting on the device (runner/speculative.DraftState): 1 → the row's position, KV slot and context length come
    # from its slot's device token count; a sequence's first row's slot when its drafts come from the device, else -1
    from_device: torch.Tensor = region(ROWS, 0)
    draft_slots: torch.Tensor = region(ROWS, -1)
    draft_sampled: torch.Tensor = region(ROWS, 0)  # 1: its sequence samples its drafts from the draft model's q
    tail_rows: torch.Tensor = region(ROWS, -1)  # an fp8 cache's tail row of each row's token (prepare_decode writes it)
    temperature: torch.Tensor = region(ROWS, 0.0, np.float32)
    top_p: torch.Tensor = region(ROWS, 1.0, np.float32)
    top_k: torch.Tensor = region(ROWS, 0)
    min_p: torch.Tensor = region(ROWS, 0.0, np.float32)

    def sampling(self, rows: int) -> SamplingTensors:
        return SamplingTensors(self.temperature[:rows], self.top_p[:rows], self.top_k[:rows], self.min_p[:rows])


@dataclass
class TokenViews:
    """A prompt / mixed step's inputs (what the token-count graphs read; the eager forward too)."""

    ids: torch.Tensor = region(TOKENS, 0)  # -1: the slot's last sampled token (a decode row)
    positions: torch.Tensor = region(TOKENS, 0)
    slot_mapping: torch.Tensor = region(TOKENS, DUMMY_KV_SLOT)
    token_slots: torch.Tensor = region(TOKENS, DUMMY_SLOT)
    slots: torch.Tensor = region(SEQS, DUMMY_SLOT)  # each sequence's slot (its block-table row)
    context_lens: torch.Tensor = region(SEQS, 0)
    cu_seqlens_q: torch.Tensor = region(SEQS_PLUS_1, TOTAL)
    work_seq: torch.Tensor = region(WORK, -1)  # the paged prefill kernel's work list (kernels.attention)
    work_start: torch.Tensor = region(WORK, -1)
    tail_rows: torch.Tensor = region(TOKENS, -1)  # an fp8 cache's tail row of each token (-1: none; tail_rows())


@dataclass
class StepTail:
    """A prompt / mixed step's variable-length arrays, read by the eager work after the forward."""

    sample_token_rows: torch.Tensor = region()  # the token row of each sampled sequence's last token
    sampled_slots: torch.Tensor = region()
    update_slots: torch.Tensor = region()  # block_table[update_slots[i], update_cols[i]] = update_ids[i]
    update_cols: torch.Tensor = region()
    update_ids: torch.Tensor = region()
    logprob_rows: torch.Tensor = region()  # token rows whose next prompt token's logprob is asked ...
    logprob_targets: torch.Tensor = region()  # ... for these tokens
    draft_ids: torch.Tensor = region()  # verification: per sampled row, the draft its sample must equal (-1: none) ...
    group_back: torch.Tensor = region()  # ... and how many sampled rows of its sequence precede it (empty: no drafts)
    known_slots: torch.Tensor = region()  # drafting on the device: the prompt tokens this step makes known to the
    known_positions: torch.Tensor = region()  # device (its chunks and cached prefixes), for the slots' histories
    known_ids: torch.Tensor = region()
    temperature: torch.Tensor = region(dtype=np.float32)  # the sampled rows' parameters (empty: no sampling)
    top_p: torch.Tensor = region(dtype=np.float32)
    top_k: torch.Tensor = region()
    min_p: torch.Tensor = region(dtype=np.float32)

    def sampling(self) -> SamplingTensors:
        return SamplingTensors(self.temperature, self.top_p, self.top_k, self.min_p)


def _aligned(words: int) -> int:
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


class _Field(NamedTuple):
    name: str
    length: str | None
    pad: Any
    is_float: bool


@functools.cache
def _fields(record: type) -> tuple[_Field, ...]:
    """A record's regions in order (read once: the loads run every step)."""
    return tuple(_Field(f.name, f.metadata["length"], f.metadata["pad"], f.metadata["dtype"] == np.float32)
                 for f in dataclasses.fields(record))


def _place(record: type, at: int, lengths: dict[str, int], values: dict[str, np.ndarray] | None = None):
    """{field: (start, length)} of a record laid out from word `at` (a field's length from `lengths` by its kind, else
    its value's own: an eager step's exact lengths), and the end."""
    spans = {}
    for f in _fields(record):
        n = lengths[f.length] if f.length in lengths else len(values[f.name])
        spans[f.name] = (at, n)
        at += _aligned(n)
    return spans, at


def _write(host: np.ndarray, record: type, spans: dict, values: dict[str, np.ndarray], pads: dict) -> None:
    """Each field's values into its region, the rest of the region padded."""
    floats = host.view(np.float32)
    for f in _fields(record):
        start, width = spans[f.name]
        v = values.get(f.name, ())
        dst = floats if f.is_float else host
        n = len(v)
        dst[start:start + n] = v
        if n < width:
            dst[start + n:start + width] = pads[f.pad] if isinstance(f.pad, str) else f.pad


def _views(record: type, device: torch.Tensor, spans: dict):
    """The record of device views (float regions viewed as float32)."""
    out = {}
    for f in _fields(record):
        start, n = spans[f.name]
        view = device[start:start + n]
        out[f.name] = view.view(torch.float32) if f.is_float else view
    return record(**out)


class PersistentState:
    def __init__(self, max_num_seqs: int, max_blocks: int, dummy_block: int, device: torch.device):
        self.dummy_slot = max_num_seqs
        self.dummy_block = dummy_block
        self.block_tables = torch.full((max_num_seqs + 1, max_blocks), dummy_block, dtype=torch.int32, device=device)
        self.last_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.drafting = None  # a runner/speculative.DraftState when drafts are proposed on the device
        self.draft_model = None  # a runner/draft_model.DraftModel when a draft model proposes them
        self.tail_block_size: int | None = None  # an fp8 KV cache's tail (kernels/kv_quant.py): its blocks' size

    def apply(self, tail: StepTail) -> None:
        """A step's block-table updates on the device, and the prompt tokens it makes known (graph-capturable)."""
        self.block_tables.index_put_((tail.update_slots.long(), tail.update_cols.long()), tail.update_ids)
        if self.drafting is not None:
            self.drafting.record_known(tail.known_slots, tail.known_positions, tail.known_ids)

    def write_tables(self, slots: np.ndarray, tables: np.ndarray) -> None:
        """Whole rows at once, outside any graph (benchmarks and tests)."""
        dev = self.block_tables.device
        self.block_tables[torch.from_numpy(slots).to(dev).long(), :tables.shape[1]] = torch.from_numpy(tables).to(dev)


class _PinnedRing:
    """Two pinned host buffers used in turn, each with an event marking its last copy to the device."""

    def __init__(self, words: int, on_cuda: bool):
        self.buffers = [torch.zeros(words, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        buf, event = self.buffers[self.turn], self.events[self.turn]
        self.turn ^= 1
        if event is not None:
            event.synchronize()  # its previous copy was queued two steps ago; normally long done
        return buf, event

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor, event: torch.cuda.Event | None) -> None:
        if event is None:
            dst.copy_(src)
        else:
            dst.copy_(src, non_blocking=True)
            event.record()


class DecodeInputs:
    def __init__(self, max_rows: int, state: PersistentState, dummy_kv_slot: int, device: torch.device):
        self.max_rows, self.state = max_rows, state
        self.pads = {DUMMY_SLOT: state.dummy_slot, DUMMY_KV_SLOT: dummy_kv_slot}
        self.words = _place(DecodeViews, 0, {ROWS: max_rows})[1]
        self.device_buf = torch.zeros(self.words, dtype=torch.int32, device=device)
        self._ring = _PinnedRing(self.words, device.type == "cuda")
        self._spans: dict[int, tuple[dict, int]] = {}
        self._views: dict[int, DecodeViews] = {}

    def _layout(self, rows: int) -> tuple[dict, int]:
        if rows not in self._spans:
            self._spans[rows] = _place(DecodeViews, 0, {ROWS: rows})
        return self._spans[rows]

    def views(self, rows: int) -> DecodeViews:
        """The device views of the region for `rows` rows (made once per row count: they never move)."""
        if rows not in self._views:
            self._views[rows] = _views(DecodeViews, self.device_buf, self._layout(rows)[0])
        return self._views[rows]

    def load(self, values: dict[str, np.ndarray], rows: int) -> None:
        """Write a decode step's arrays (decode_values) into the region of `rows` rows (the rest is padding), one
        copy to the device."""
        spans, end = self._layout(rows)
        host, event = self._ring.next()
        _write(host.numpy(), DecodeViews, spans, values, self.pads)
        self._ring.copy(self.device_buf[:end], host[:end], event)


def decode_values(batch: DecodeBatch) -> dict[str, np.ndarray]:
    """A DecodeBatch's arrays by DecodeViews field (without sampling the sampling regions are padding)."""
    values = {"slots": batch.slots, "positions": batch.positions, "slot_mapping": batch.slot_mapping,
              "context_lens": batch.context_lens, "new_block_cols": batch.new_block_cols,
              "new_block_ids": batch.new_block_ids}
    if batch.draft_ids is not None:
        values |= {"token_ids": batch.token_ids, "draft_ids": batch.draft_ids, "group_back": batch.group_back}
    if batch.from_device is not None:
        values |= {"from_device": batch.from_device, "draft_slots": batch.draft_slots}
    if batch.sampling is not None and batch.sampling.draft_sampled is not None:
        values["draft_sampled"] = batch.sampling.draft_sampled
    return values | sampling_values(batch.sampling)


def sampling_values(sb: SamplingBatch | None) -> dict[str, np.ndarray]:
    if sb is None:
        return {}
    return {"temperature": sb.temperature, "top_p": sb.top_p, "top_k": sb.top_k, "min_p": sb.min_p}


def token_values(batch: PrefillBatch, q_per_tile: int,
                 tail_block_size: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A prompt / mixed step's host arrays by TokenViews and by StepTail field, shared by its eager and graph
    forms. tail_block_size: the KV cache keeps a tail (fp8) of blocks of that size."""
    total = int(batch.query_lens.sum())
    offsets = np.repeat(np.cumsum(batch.query_lens) - batch.query_lens, batch.query_lens)
    positions = np.arange(total, dtype=np.int64) - offsets + np.repeat(batch.starts, batch.query_lens)
    cu_q = np.zeros(len(batch.slots) + 1, np.int32)
    np.cumsum(batch.query_lens, out=cu_q[1:])
    context_lens = (batch.starts + batch.query_lens).astype(np.int32)
    work_seq, work_start = prefill_work(batch.query_lens, q_per_tile, context_lens)
    token_slots = np.repeat(batch.slots, batch.query_lens)
    static = {"ids": batch.token_ids, "positions": positions.astype(np.int32), "slot_mapping": batch.slot_mapping,
              "token_slots": token_slots, "slots": batch.slots, "context_lens": context_lens, "cu_seqlens_q": cu_q,
              "work_seq": work_seq, "work_start": work_start,
              "tail_rows": tail_rows(token_slots, positions, np.repeat(context_lens, batch.query_lens),
                                     tail_block_size)}
    u = batch.block_updates
    tail = _sampled_rows(batch, cu_q) | {
        "update_slots": u.slots, "update_cols": u.cols, "update_ids": u.block_ids,
        "logprob_rows": batch.prompt_logprob_rows, "logprob_targets": batch.prompt_logprob_targets,
        "known_slots": batch.known_slots, "known_positions": batch.known_positions, "known_ids": batch.known_ids}
    empty_f, empty_i = np.zeros(0, np.float32), np.zeros(0, np.int32)
    tail |= {"temperature": empty_f, "top_p": empty_f, "top_k": empty_i, "min_p": empty_f}
    return static, tail | sampling_values(batch.sampling)


def tail_rows(token_slots: np.ndarray, positions: np.ndarray, ends: np.ndarray, block_size: int | None) -> np.ndarray:
    """Each token's tail row (kernels/kv_quant.tail_row), -1 for those before its sequence's last two blocks of the
    step (ends: its sequence's length after the step): a long chunk's earlier tokens would race for the two banks,
    and no later step reads them from the tail. All -1 without a tail."""
    if block_size is None:
        return np.full(len(positions), -1, np.int32)
    keep = positions // block_size >= (ends - 1) // block_size - 1
    return np.where(keep, tail_row(token_slots.astype(np.int64), positions, block_size), -1).astype(np.int32)


def _sampled_rows(batch: PrefillBatch, cu_q: np.ndarray) -> dict[str, np.ndarray]:
    """The token rows whose logits are sampled and their slots: each sampled sequence's last token, or (verifying
    drafts) its last sample_counts[i] tokens, with the drafts they verify and their sequence's first row."""
    last = (cu_q[1:][batch.sample_rows] - 1).astype(np.int32)
    slots = batch.slots[batch.sample_rows]
    if batch.sample_counts is None:
        none = np.zeros(0, np.int32)
        return {"sample_token_rows": last, "sampled_slots": slots, "draft_ids": none, "group_back": none}
    counts = batch.sample_counts
    first = np.cumsum(counts) - counts  # each sequence's first sampled row
    within = np.arange(int(counts.sum()), dtype=np.int32) - np.repeat(first, counts)
    rows = np.repeat(last - counts + 1, counts) + within
    return {"sample_token_rows": rows.astype(np.int32), "sampled_slots": np.repeat(slots, counts),
            "draft_ids": batch.draft_ids, "group_back": within}


class StepPacker:
    """Packs an eager step's records (at their own lengths) into one pinned buffer and copies it once. One device
    buffer suffices: the next step's copy is queued behind this step's kernels on the stream."""

    def __init__(self, device: torch.device, words: int = 1 << 16):
        self.device = device
        self._on_cuda = device.type == "cuda"
        self._words = words
        self._ring = _PinnedRing(words, self._on_cuda)
        self._device_buf = torch.zeros(words, dtype=torch.int32, device=device)

    def pack(self, static: dict[str, np.ndarray], tail: dict[str, np.ndarray]) -> tuple[TokenViews, StepTail]:
        spans, at = _place(TokenViews, 0, {}, static)
        tail_spans, end = _place(StepTail, at, {}, tail)
        if end > self._words:
            self._grow(end)
        host, event = self._ring.next()
        _write(host.numpy(), TokenViews, spans, static, {})
        _write(host.numpy(), StepTail, tail_spans, tail, {})
        self._ring.copy(self._device_buf[:end], host[:end], event)
        return _views(TokenViews, self._device_buf, spans), _views(StepTail, self._device_buf, tail_spans)

    def _grow(self, words: int) -> None:
        if self._on_cuda:
            torch.cuda.synchronize(self.device)  # the old buffers may still be read by queued work
        self._words = max(words, 2 * self._words)
        self._ring = _PinnedRing(self._words, self._on_cuda)
        self._device_buf = torch.zeros(self._words, dtype=torch.int32, device=self.device)


class TokenInputs:
    VARIABLE_WORDS = 1 << 17  # a step whose tail needs more (many long prefix hits at once) runs eagerly

    def __init__(self, max_tokens: int, max_seqs: int, q_per_tile: int, state: PersistentState, dummy_kv_slot: int,
                 device: torch.device):
        self.max_tokens, self.max_seqs, self.q_per_tile = max_tokens, max_seqs, q_per_tile
        self.state = state
        self.pads = {DUMMY_SLOT: state.dummy_slot, DUMMY_KV_SLOT: dummy_kv_slot}
        self.words = self._layout(max_tokens)[1] + self.VARIABLE_WORDS
        self.device_buf = torch.zeros(self.words, dtype=torch.int32, device=device)
        self._ring = _PinnedRing(self.words, device.type == "cuda")
        self._spans: dict[int, tuple[dict, int]] = {}
        self._views: dict[int, TokenViews] = {}

    def _layout(self, tokens: int) -> tuple[dict, int]:
        """TokenViews' regions for `tokens` tokens, and their end (where the tail starts)."""
        lengths = {TOKENS: tokens, SEQS: self.max_seqs, SEQS_PLUS_1: self.max_seqs + 1,
                   WORK: prefill_work_capacity(tokens, self.max_seqs, self.q_per_tile)}
        return _place(TokenViews, 0, lengths)

    def views(self, tokens: int) -> TokenViews:
        if tokens not in self._views:
            self._spans[tokens] = self._layout(tokens)
            self._views[tokens] = _views(TokenViews, self.device_buf, self._spans[tokens][0])
        return self._views[tokens]

    def fits(self, batch: PrefillBatch, tail: dict[str, np.ndarray]) -> bool:
        """Whether the step fits the static buffer (its sequences and its variable arrays)."""
        need = sum(_aligned(len(v)) for v in tail.values())
        return need <= self.VARIABLE_WORDS and len(batch.slots) <= self.max_seqs

    def load(self, static: dict[str, np.ndarray], tail: dict[str, np.ndarray], tokens: int) -> StepTail:
        """Write the step (token_values) into the region of `tokens` ≥ its token count, one copy; the tail's device
        views (the caller checked fits())."""
        self.views(tokens)
        spans, at = self._spans[tokens]
        tail_spans, end = _place(StepTail, at, {}, tail)
        host, event = self._ring.next()
        h = host.numpy()
        _write(h, TokenViews, spans, static, self.pads | {TOTAL: int(static["cu_seqlens_q"][-1])})
        _write(h, StepTail, tail_spans, tail, {})
        self._ring.copy(self.device_buf[:end], host[:end], event)
        return _views(StepTail, self.device_buf, tail_spans)
