"""The one timing loop: the graph planner's replay probes, `nanoserve bench graphs` and the benchmarks measure
a call the same way."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], device: torch.device | str, warmup: int = 5, iters: int = 30) -> list[float]:
    """Per-call times in ms. On CUDA: synchronize, record an event, call, record an event —
    each sample covers one call's host launch work plus its GPU execution, as in a real step.
    On CPU: perf_counter."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
        if on_cuda:  # like the timed calls: a host buffer is never rewritten while a copy reads it
            torch.cuda.synchronize(device)
    samples: list[float] = []
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


__all__ = ["time_ms"]
