"""Device-resident step state and the one host→device copy of each step's inputs.

PersistentState: per slot (a running sequence's fixed row) its block table and its last sampled token,
both on the device; steps patch them, never rebuild them. Row max_num_seqs is the dummy slot that padded
rows use: its block table points every entry at the reserved dummy block.

DecodeInputs: the static buffer CUDA graphs read. For a bucket of B rows its regions are contiguous
slices of a prefix: [slots | positions | slot_mapping | context_lens | new block col | new block id |
temperature | top_p | top_k | min_p], B words each (floats stored as their bits). A step fills a pinned
host mirror (two, alternating, so the host never waits for the previous copy) and moves it with ONE
copy; padded rows get the dummy slot, the dummy KV slot and no new block.

StepPacker: the same one-copy scheme for eager (prefill / mixed) steps, whose arrays vary in length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.runner.batch import BlockUpdates, DecodeBatch, SamplingBatch
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
        total = sum(len(a) for a in arrays)
        if total > self._words:
            self._grow(total)
        host, event = self._ring.next()
        h = host.numpy()
        views, at = [], 0
        dev = self._device_buf
        for a in arrays:
            n = len(a)
            h[at:at + n] = a.view(np.int32) if a.dtype == np.float32 else a
            view = dev[at:at + n]
            views.append(view.view(torch.float32) if a.dtype == np.float32 else view)
            at += n
        self._ring.copy(dev[:at], host[:at], event)
        return views

    def _grow(self, words: int) -> None:
        if self._on_cuda:
            torch.cuda.synchronize(self.device)  # the old buffers may still be read by queued work
        self._words = max(words, 2 * self._words)
        self._ring = _PinnedRing(self._words, self._on_cuda)
        self._device_buf = torch.zeros(self._words, dtype=torch.int32, device=self.device)


def sampling_arrays(sb: SamplingBatch) -> list[np.ndarray]:
    return [sb.temperature, sb.top_p, sb.top_k, sb.min_p]


def updates_arrays(u: BlockUpdates) -> list[np.ndarray]:
    return [u.slots, u.cols, u.block_ids]
