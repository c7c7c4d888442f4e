"""CUDA-graph decode: one graph per batch-size bucket over static inputs, replayed with padding.

A graph replays fixed kernels on fixed addresses, so the decode forward reads only static buffers:
the flat DecodeInputs buffer (allocated once for the largest bucket; a bucket of B rows reads the
regions of its prefix) and the persistent per-slot state. A batch of b rows replays the smallest
bucket B ≥ b; rows b..B-1 are padding that touch only the dummy slot and the dummy KV block. Graphs
are captured largest first into one shared memory pool, after warm-up forwards on a side stream (so
allocator state and Triton compilation stay out of the graphs). Each graph keeps its own output
tensor (the logits), valid until the next replay.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

logger = logging.getLogger("nanoserve")


def bucket_for(capture_sizes: list[int], batch_size: int) -> int | None:
    """The bucket a batch of batch_size rows replays: the smallest captured size ≥ batch_size (sizes ascending);
    None when it is larger than every bucket (it then runs eagerly)."""
    i = bisect.bisect_left(capture_sizes, batch_size)
    return capture_sizes[i] if i < len(capture_sizes) else None


class GraphRunner:
    """forward(rows) → logits [rows, vocab] reads only static buffers; prepare(rows) loads an all-padding batch."""

    def __init__(self, forward: Callable[[int], torch.Tensor], prepare: Callable[[int], None],
                 capture_sizes: list[int]):
        if not capture_sizes:
            raise ValueError("GraphRunner needs at least one capture size")
        self.forward, self.prepare = forward, prepare
        self.capture_sizes = sorted(capture_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def bucket_for(self, batch_size: int) -> int | None:
        return bucket_for(self.capture_sizes, batch_size)

    @torch.inference_mode()
    def capture(self, show_progress: bool = True) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        sizes = list(reversed(self.capture_sizes))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for rows in sizes:
                self.prepare(rows)
                for _ in range(2):
                    self.forward(rows)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for rows in tqdm(sizes, desc="Capturing CUDA graphs", disable=not show_progress, leave=False):
            self.prepare(rows)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[rows] = self.forward(rows)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved_before

    def replay(self, rows: int) -> torch.Tensor:
        """Replay bucket `rows` (its inputs already loaded); its logits [rows, vocab]."""
        self.graphs[rows].replay()
        return self.outputs[rows]
