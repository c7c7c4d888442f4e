"""Device-resident step state and the one host→device copy of each step's inputs.

PersistentState: per slot (a running sequence's fixed row) its block table and its last sampled token,
both on the device; steps patch them, never rebuild them. Row max_num_seqs is the dummy slot that padded
rows use: its block table points every entry at the reserved dummy block.

DecodeInputs: the static buffer CUDA graphs read. For a bucket of B rows its regions are contiguous
slices of a prefix: [slots | positions | slot_mapping | context_lens | new block col | new block id |
temperature | top_p | top_k | min_p], B words each (floats stored as their bits). A step fills a pinned
host mirror (two, alternating, so the host never waits for the previous copy) and moves it with ONE
copy; padded rows get the dummy slot, the dummy KV slot and no new block.

TokenInputs: the static buffer the token-count graphs (prompt and mixed steps) read. For T tokens:
[ids | positions | slot_mapping | token slots] (T words each), [slots | context_lens] (max_num_seqs each),
cu_seqlens_q (max_num_seqs + 1), the attention work list [sequence | first token] (its capacity for T each),
then the step's variable-length arrays (sampled rows, block-table updates, sampling parameters), which
only eager work after the replay reads: again ONE copy. Padded tokens run the dummy slot's token into the
dummy KV slot; padded sequences are empty (no tokens, no context); unused work entries are -1.

StepPacker: the same one-copy scheme for eager (prefill / mixed) steps, whose arrays vary in length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.kernels.attention import prefill_work, prefill_work_capacity
from nanoserve.runner.batch import BlockUpdates, DecodeBatch, PrefillBatch, SamplingBatch
from nanoserve.runner.sampler import SamplingTensors

DECODE_INT_REGIONS = 6  # slots, positions, slot_mapping, context_lens, new block col, new block id
SAMPLING_REGIONS = 4  # temperature, top_p, top_k, min_p


class PersistentState:
    def __init__(self, max_num_seqs: int, max_blocks: int, dummy_block: int, device: torch.device):
        self.dummy_slot = max_num_seqs
        self.dummy_block = dummy_block
        self.block_tables = torch.full((max_num_seqs + 1, max_blocks), dummy_block, dtype=torch.int32, device=device)
        self.last_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)

    def apply(self, slots: torch.Tensor, cols: torch.Tensor, block_ids: torch.Tensor) -> None:
        """block_tables[slots[i], cols[i]] = block_ids[i] on the device (graph-capturable)."""
        self.block_tables.index_put_((slots.long(), cols.long()), block_ids)

    def write_tables(self, slots: np.ndarray, tables: np.ndarray) -> None:
        """Whole rows at once, outside any graph (benchmarks and tests)."""
        dev = self.block_tables.device
        self.block_tables[torch.from_numpy(slots).to(dev).long(), :tables.shape[1]] = torch.from_numpy(tables).to(dev)


@dataclass
class DecodeViews:
    slots: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    new_block_cols: torch.Tensor
    new_block_ids: torch.Tensor
    sampling: SamplingTensors


class _PinnedRing:
    """Two pinned host buffers used in turn, each with an event marking its last copy to the device."""

    def __init__(self, words: int, on_cuda: bool):
        self.on_cuda = on_cuda
        self.buffers = [torch.zeros(words, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        buf, event = self.buffers[self.turn], self.events[self.turn]
        self.turn ^= 1
        if event is not None:
            event.synchronize()  # its previous copy was queued two steps ago; normally long done
        return buf, event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, event: torch.cuda.Event | None) -> None:
        if event is None:
            dst.copy_(src)
        else:
            dst.copy_(src, non_blocking=True)
            event.record()


class DecodeInputs:
    def __init__(self, max_rows: int, state: PersistentState, dummy_kv_slot: int, device: torch.device):
        self.max_rows, self.state, self.dummy_kv_slot = max_rows, state, dummy_kv_slot
        self.words = max_rows * (DECODE_INT_REGIONS + SAMPLING_REGIONS)
        self.device_buf = torch.zeros(self.words, dtype=torch.int32, device=device)
        self._ring = _PinnedRing(self.words, device.type == "cuda")
        self._views: dict[int, DecodeViews] = {}

    def views(self, rows: int) -> DecodeViews:
        """The device views of the region for `rows` rows (made once per row count: they never move)."""
        if rows not in self._views:
            self._views[rows] = self._make_views(rows)
        return self._views[rows]

    def _make_views(self, rows: int) -> DecodeViews:
        r, buf = rows, self.device_buf
        ints = [buf[i * r:(i + 1) * r] for i in range(DECODE_INT_REGIONS)]
        base = DECODE_INT_REGIONS * r
        s = [buf[base + i * r:base + (i + 1) * r] for i in range(SAMPLING_REGIONS)]
        sampling = SamplingTensors(s[0].view(torch.float32), s[1].view(torch.float32), s[2], s[3].view(torch.float32))
        return DecodeViews(*ints, sampling)

    def load(self, batch: DecodeBatch, rows: int) -> None:
        """Write batch into the region of `rows` ≥ batch.size rows (the rest is padding), one copy to the device."""
        r = rows
        host, event = self._ring.next()
        h = host.numpy()
        f = h.view(np.float32)
        _fill(h, 0, r, batch.slots, self.state.dummy_slot)
        _fill(h, r, r, batch.positions, 0)
        _fill(h, 2 * r, r, batch.slot_mapping, self.dummy_kv_slot)
        _fill(h, 3 * r, r, batch.context_lens, 1)
        _fill(h, 4 * r, r, batch.new_block_cols, -1)
        _fill(h, 5 * r, r, batch.new_block_ids, 0)
        sb = batch.sampling
        base = DECODE_INT_REGIONS * r
        if sb is not None:
            _fill(f, base, r, sb.temperature, 0.0)
            _fill(f, base + r, r, sb.top_p, 1.0)
            _fill(h, base + 2 * r, r, sb.top_k, 0)
            _fill(f, base + 3 * r, r, sb.min_p, 0.0)
        n = (DECODE_INT_REGIONS + SAMPLING_REGIONS) * r
        self._ring.copy(self.device_buf[:n], host[:n], event)


def _fill(dst: np.ndarray, start: int, width: int, values: np.ndarray, pad) -> None:
    n = len(values)
    dst[start:start + n] = values
    dst[start + n:start + width] = pad


class StepPacker:
    """Packs a step's variable-length int32/float32 arrays into one pinned buffer and copies it once.
    One device buffer suffices: the next step's copy is queued behind this step's kernels on the stream."""

    def __init__(self, device: torch.device, words: int = 1 << 16):
        self.device = device
        self._on_cuda = device.type == "cuda"
        self._words = words
        self._ring = _PinnedRing(words, self._on_cuda)
        self._device_buf = torch.zeros(words, dtype=torch.int32, device=device)

    def pack(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        total = sum(_aligned(len(a)) for a in arrays)
        if total > self._words:
            self._grow(total)
        host, event = self._ring.next()
        views, at = _pack(host.numpy(), self._device_buf, 0, arrays)
        self._ring.copy(self._device_buf[:at], host[:at], event)
        return views

    def _grow(self, words: int) -> None:
        if self._on_cuda:
            torch.cuda.synchronize(self.device)  # the old buffers may still be read by queued work
        self._words = max(words, 2 * self._words)
        self._ring = _PinnedRing(self._words, self._on_cuda)
        self._device_buf = torch.zeros(self._words, dtype=torch.int32, device=self.device)


@dataclass
class TokenViews:
    ids: torch.Tensor  # [T]; -1: the slot's last sampled token (a decode row)
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_slots: torch.Tensor
    slots: torch.Tensor  # [S]: each sequence's slot (its block-table row)
    context_lens: torch.Tensor  # [S]
    cu_seqlens_q: torch.Tensor  # [S + 1]
    work_seq: torch.Tensor  # [W]
    work_start: torch.Tensor  # [W]


@dataclass
class StepArrays:
    """The host arrays of a prompt / mixed step, shared by its eager and graph forms."""

    positions: np.ndarray
    token_slots: np.ndarray
    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    work_seq: np.ndarray
    work_start: np.ndarray
    variable: list[np.ndarray]  # sample token rows, sampled slots, block updates (3), prompt-logprob rows and
    # targets, sampling (4) if any

    @classmethod
    def of(cls, batch: PrefillBatch, q_per_tile: int) -> "StepArrays":
        total = int(batch.query_lens.sum())
        offsets = np.repeat(np.cumsum(batch.query_lens) - batch.query_lens, batch.query_lens)
        positions = (np.arange(total, dtype=np.int64) - offsets + np.repeat(batch.starts, batch.query_lens))
        cu_q = np.zeros(len(batch.slots) + 1, np.int32)
        np.cumsum(batch.query_lens, out=cu_q[1:])
        sample_token_rows = (cu_q[1:][batch.sample_rows] - 1).astype(np.int32)
        sampling = sampling_arrays(batch.sampling) if batch.sampling is not None else []
        context_lens = (batch.starts + batch.query_lens).astype(np.int32)
        return cls(positions.astype(np.int32), np.repeat(batch.slots, batch.query_lens), cu_q, context_lens,
                   *prefill_work(batch.query_lens, q_per_tile, context_lens),
                   [sample_token_rows, batch.slots[batch.sample_rows], *updates_arrays(batch.block_updates),
                    batch.prompt_logprob_rows, batch.prompt_logprob_targets, *sampling])


class TokenInputs:
    VARIABLE_WORDS = 1 << 17  # a step whose variable arrays need more (many long prefix hits at once) runs eagerly

    def __init__(self, max_tokens: int, max_seqs: int, q_per_tile: int, state: PersistentState, dummy_kv_slot: int,
                 device: torch.device):
        self.max_tokens, self.max_seqs, self.q_per_tile = max_tokens, max_seqs, q_per_tile
        self.state, self.dummy_kv_slot = state, dummy_kv_slot
        self.words = self.static_words(max_tokens) + self.VARIABLE_WORDS
        self.device_buf = torch.zeros(self.words, dtype=torch.int32, device=device)
        self._ring = _PinnedRing(self.words, device.type == "cuda")
        self._views: dict[int, TokenViews] = {}

    def work_capacity(self, tokens: int) -> int:
        return prefill_work_capacity(tokens, self.max_seqs, self.q_per_tile)

    def static_words(self, tokens: int) -> int:
        start, n = self._layout(tokens)[-1]
        return _aligned(start + n)

    def _layout(self, tokens: int) -> list[tuple[int, int]]:
        """(start, length) of each TokenViews field in the buffer for `tokens` tokens."""
        t, s, w = tokens, self.max_seqs, self.work_capacity(tokens)
        lengths, out, at = [t, t, t, t, s, s, s + 1, w, w], [], 0
        for n in lengths:
            out.append((at, n))
            at += _aligned(n)
        return out

    def views(self, tokens: int) -> TokenViews:
        if tokens not in self._views:
            self._views[tokens] = TokenViews(*(self.device_buf[a:a + n] for a, n in self._layout(tokens)))
        return self._views[tokens]

    def load(self, batch: PrefillBatch, a: StepArrays, tokens: int) -> list[torch.Tensor] | None:
        """Write the step into the region of `tokens` ≥ its token count (one copy); the device views of its
        variable arrays, or None when they do not fit (the step then runs eagerly)."""
        need = sum(_aligned(len(x)) for x in a.variable)
        if need > self.VARIABLE_WORDS or len(batch.slots) > self.max_seqs:
            return None
        host, event = self._ring.next()
        h = host.numpy()
        total = int(a.cu_seqlens_q[-1])
        pads = [0, 0, self.dummy_kv_slot, self.state.dummy_slot, self.state.dummy_slot, 0, total, -1, -1]
        values = [batch.token_ids, a.positions, batch.slot_mapping, a.token_slots, batch.slots, a.context_lens,
                  a.cu_seqlens_q, a.work_seq, a.work_start]
        for (start, n), v, pad in zip(self._layout(tokens), values, pads):
            _fill(h, start, n, v, pad)
        views, at = _pack(h, self.device_buf, self.static_words(tokens), a.variable)
        self._ring.copy(self.device_buf[:at], host[:at], event)
        return views


ALIGN_WORDS = 4  # every packed array starts 16-byte aligned: Triton specializes kernels on pointer alignment, so
# arrays at arbitrary offsets would compile a new variant of a kernel whenever a step meets a new alignment mix


def _aligned(words: int) -> int:
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


def _pack(host: np.ndarray, device: torch.Tensor, at: int, arrays: list[np.ndarray]) -> tuple[list[torch.Tensor], int]:
    """Write arrays into host[at:] (each aligned) and return their views in `device` and the end offset."""
    views = []
    for a in arrays:
        n = len(a)
        host[at:at + n] = a.view(np.int32) if a.dtype == np.float32 else a
        view = device[at:at + n]
        views.append(view.view(torch.float32) if a.dtype == np.float32 else view)
        at += _aligned(n)
    return views, at


def sampling_arrays(sb: SamplingBatch) -> list[np.ndarray]:
    return [sb.temperature, sb.top_p, sb.top_k, sb.min_p]


def updates_arrays(u: BlockUpdates) -> list[np.ndarray]:
    return [u.slots, u.cols, u.block_ids]
