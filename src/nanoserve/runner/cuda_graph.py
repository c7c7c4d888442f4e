"""CUDA-graph decode: one graph per batch-size bucket over static inputs, replayed with padding.

A graph replays fixed kernels on fixed addresses, so the decode forward reads only static buffers:
the flat DecodeInputs buffer (allocated once for the largest bucket; a bucket of B rows reads the
regions of its prefix) and the persistent per-slot state. A batch of b rows replays the smallest
bucket B ≥ b; rows b..B-1 are padding that touch only the dummy slot and the dummy KV block. Graphs
are captured largest first into one shared memory pool, each after warm-up forwards on a side stream
(so allocator state and Triton compilation stay out of the graphs). Each graph keeps its own output
tensor (the logits), valid until the next replay; any graph may be replayed in any order, since
nothing but those outputs outlives a replay.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable

import torch
from tqdm import tqdm

logger = logging.getLogger("nanoserve")


@functools.cache
def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """The one side stream every capture warms up on. cuBLAS keeps a workspace (32 MiB on Hopper) per stream it
    has run on, for the life of the process: a fresh stream per capture cost 32 MiB of memory per graph."""
    return torch.cuda.Stream(device)


class GraphRunner:
    """forward(rows) → its output (logits [rows, vocab], or hidden states [tokens, hidden] for the token-count
    graphs) reads only static buffers; prepare(rows) loads an all-padding batch. `rows` is the batch size of a
    decode graph or the token count of a prompt / mixed step's graph. pool: share another runner's graph pool.
    record=False keeps the sizes without capturing: replay runs the same forward eagerly (its "eager twin", which
    the CPU tests run through the graph path's static buffers and padding)."""

    def __init__(self, forward: Callable[[int], torch.Tensor], prepare: Callable[[int], None], pool=None,
                 record: bool = True):
        self.forward, self.prepare, self.record = forward, prepare, record
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_times: dict[int, float] = {}  # seconds to warm up and capture each size, compilation excluded
        self.wall_seconds = 0.0  # all capture calls, compilation included
        self.pool_growth: dict[int, int] = {}  # bytes the pool grew by when each size was captured
        self.pool = pool
        self.capture_sizes: list[int] = []

    @property
    def capture_seconds(self) -> float:
        """Warm-up + capture of the current sizes with compiled kernels (a start-up with a warm Triton cache)."""
        return sum(self.capture_times.get(s, 0.0) for s in self.capture_sizes)

    @property
    def pool_bytes(self) -> int:
        return sum(self.pool_growth.values())

    @torch.inference_mode()
    def capture(self, sizes: Iterable[int], show_progress: bool = False) -> None:
        """Capture these sizes (largest first) into the shared pool, next to those already captured."""
        todo = sorted(set(sizes) - set(self.graphs), reverse=True)
        if not self.record:
            self.graphs.update(dict.fromkeys(todo))
            self.capture_sizes = sorted(self.graphs)
            return
        for rows in tqdm(todo, desc="Capturing CUDA graphs", disable=not show_progress, leave=False):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved()
            start = time.perf_counter()
            self.prepare(rows)
            side = _warm_up_stream(torch.cuda.current_device())
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(rows)  # the first warm-up also compiles what this size needs
                torch.cuda.synchronize()
                warm = time.perf_counter()
                self.forward(rows)
                torch.cuda.synchronize()
                second = time.perf_counter() - warm
            torch.cuda.current_stream().wait_stream(side)
            recording = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[rows] = self.forward(rows)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[rows] = graph
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.wall_seconds += now - start
            self.capture_times[rows] = 2 * second + (now - recording)  # what it costs once kernels are compiled
            torch.cuda.empty_cache()
            self.pool_growth[rows] = torch.cuda.memory_reserved() - reserved
        self.capture_sizes = sorted(self.graphs)

    def drop(self, sizes: Iterable[int]) -> None:
        """Forget these graphs (their memory returns to the shared pool for the others)."""
        for rows in sizes:
            self.graphs.pop(rows, None)
            self.outputs.pop(rows, None)
        if not self.graphs:
            self.pool = None  # its last graph is gone: the pool was freed with it
        self.capture_sizes = sorted(self.graphs)

    def replay(self, rows: int) -> torch.Tensor:
        """Replay bucket `rows` (its inputs already loaded); its output."""
        graph = self.graphs[rows]
        if graph is None:
            return self.forward(rows)
        graph.replay()
        return self.outputs[rows]
