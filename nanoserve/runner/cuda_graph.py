"""CUDA-graph decode: static buffers, one graph per batch-size bucket, replay with padding.

A graph replays fixed kernels on fixed addresses, so every decode input lives in one flat int32
buffer allocated once for the largest batch. For a bucket of B rows the inputs are contiguous
regions of its prefix: [ids B | positions B | slots B | context_lens B | block_tables B*W].
A step fills a pinned host copy and moves it with one host→device copy; padded rows point at
the reserved dummy KV block, so they cannot touch a real sequence's cache. Graphs are captured
largest first into one shared memory pool, after warm-up forwards on a side stream.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from nanoserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger("nanoserve")


@dataclass
class DecodeBatch:
    """Host-side decode inputs for b sequences (int32 numpy arrays)."""

    input_ids: np.ndarray  # [b]
    positions: np.ndarray  # [b]
    slot_mapping: np.ndarray  # [b]
    context_lens: np.ndarray  # [b]
    block_tables: np.ndarray  # [b, w], w ≤ max_blocks_per_seq

    @property
    def size(self) -> int:
        return len(self.input_ids)


class StaticDecodeInputs:
    """The flat decode-input buffer (device) and its pinned host mirror, sized for max_rows."""

    def __init__(self, max_rows: int, max_blocks: int, dummy_block: int, block_size: int, device: torch.device):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.dummy_block, self.dummy_slot = dummy_block, dummy_block * block_size
        size = max_rows * (4 + max_blocks)
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda)
        self.host_np = self.host.numpy()
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device) if on_cuda else self.host
        self.copied = torch.cuda.Event() if on_cuda else None  # the host mirror is reused only after its last copy

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) over the buffer's region for `rows` rows."""
        buf, r = self.device_buf, rows
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=buf[2 * r:3 * r],
            context_lens=buf[3 * r:4 * r],
            block_tables=buf[4 * r:4 * r + r * self.max_blocks].view(r, self.max_blocks),
        )
        return buf[:r], buf[r:2 * r], meta

    def load(self, batch: DecodeBatch, rows: int) -> None:
        """Write batch into the region for `rows` ≥ batch.size rows; rows past it become padding."""
        b, r, h = batch.size, rows, self.host_np
        w = batch.block_tables.shape[1]
        if self.copied is not None:
            self.copied.synchronize()
        h[0:b], h[b:r] = batch.input_ids, 0
        h[r:r + b], h[r + b:2 * r] = batch.positions, 0
        h[2 * r:2 * r + b], h[2 * r + b:3 * r] = batch.slot_mapping, self.dummy_slot
        h[3 * r:3 * r + b], h[3 * r + b:4 * r] = batch.context_lens, 1
        tables = h[4 * r:4 * r + r * self.max_blocks].reshape(r, self.max_blocks)
        tables[:b, :w] = batch.block_tables
        tables[:b, w:] = self.dummy_block
        tables[b:] = self.dummy_block
        n = 4 * r + r * self.max_blocks
        if self.copied is not None:
            self.device_buf[:n].copy_(self.host[:n], non_blocking=True)
            self.copied.record()


class GraphRunner:
    """Captures the decode forward (+ logits) for each bucket size and replays it."""

    def __init__(self, model, inputs: StaticDecodeInputs, capture_sizes: list[int], vocab_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model, self.inputs = model, inputs
        self.capture_sizes = sorted(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        assert self.max_size <= inputs.max_rows
        self.logits = torch.empty(self.max_size, vocab_size, dtype=dtype, device=device)  # static output
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def bucket_for(self, batch_size: int) -> int | None:
        """Smallest captured size ≥ batch_size, or None when the batch is too large for any graph."""
        i = bisect.bisect_left(self.capture_sizes, batch_size)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def _forward(self, rows: int) -> None:
        input_ids, positions, meta = self.inputs.views(rows)
        hidden = self.model(input_ids, positions, meta)
        self.logits[:rows].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def capture(self, show_progress: bool = True) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        empty = DecodeBatch(*(np.zeros(0, np.int32) for _ in range(4)), np.zeros((0, 1), np.int32))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: allocator state and Triton JIT stay out of the graphs
            for rows in reversed(self.capture_sizes):
                self.inputs.load(empty, rows)
                for _ in range(2):
                    self._forward(rows)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        sizes = list(reversed(self.capture_sizes))
        for rows in tqdm(sizes, desc="Capturing CUDA graphs", disable=not show_progress, leave=False):
            self.inputs.load(empty, rows)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(rows)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved_before

    def replay(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [b, vocab] for the batch; a view into the static output, valid until the next replay."""
        rows = self.bucket_for(batch.size)
        self.inputs.load(batch, rows)
        self.graphs[rows].replay()
        return self.logits[:batch.size]
