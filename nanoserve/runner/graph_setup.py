"""Start-up of the decode graphs: measure → plan → capture → self-check.

With cudagraph_capture_sizes="auto" (the CUDA default) a few probe sizes are captured and their replays
timed; runner/bucket_plan.py fits the step-time curve and chooses the sizes that minimise the expected
padded step time over the batch-size distribution (uniform, or the histogram in cudagraph_plan) under
the capture-time and pool budgets; the missing sizes are captured and unused probes dropped. Every
captured size is then replayed once against the eager forward on the same inputs (unless
skip_graph_check): a mismatch beyond the dtype's tolerance fails start-up, naming the size.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve.runner.bucket_plan import BatchDistribution, StepCurve, plan_buckets
from nanoserve.runner.cuda_graph import GraphRunner

logger = logging.getLogger("nanoserve")

PROBE_SIZES = (1, 8, 32, 64, 128)  # plus max_num_seqs
TIMED_REPLAYS = 10
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # max |Δ logit| / max |logit|


class GraphCheckError(RuntimeError):
    """A captured graph does not reproduce the eager forward."""


def probe_sizes(max_num_seqs: int) -> list[int]:
    return sorted({s for s in PROBE_SIZES if s < max_num_seqs} | {max_num_seqs})


def measure_curve(gr: GraphRunner, load: Callable[[int], None], sizes: list[int]) -> StepCurve:
    """Capture the probe sizes and time their replays (loaded with `load(rows)`): the fitted StepCurve."""
    gr.capture(sizes)
    step_ms = {rows: _replay_ms(gr, load, rows) for rows in sizes}
    largest = max(sizes)
    extra_seconds = {r: gr.capture_times[r] for r in sizes if r != largest}
    extra_bytes = {r: gr.pool_growth[r] for r in sizes if r != largest}
    return StepCurve.fit(step_ms, {largest: gr.capture_times[largest]}, {largest: gr.pool_growth[largest]},
                         extra_seconds or None, extra_bytes or None)


def _replay_ms(gr: GraphRunner, load: Callable[[int], None], rows: int) -> float:
    load(rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gr.replay(rows)
    times = []
    for _ in range(TIMED_REPLAYS):
        start.record()
        gr.replay(rows)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def plan(curve: StepCurve, max_num_seqs: int, histogram: str | None, capture_budget_s: float,
         pool_budget_bytes: float) -> list[int]:
    dist = BatchDistribution.uniform(max_num_seqs)
    if histogram is not None and Path(histogram).is_file():
        recorded = BatchDistribution.load(histogram, max_num_seqs)
        if recorded.probabilities().sum() > 0:
            dist = recorded
    # One row always gets its own graph: a single stream (the latency a user sees first) must not pay for
    # padding that the planner accepts because b = 1 is only 1/max_num_seqs of a uniform distribution.
    return sorted(set(plan_buckets(curve, dist, max_num_seqs, capture_budget_s, pool_budget_bytes)) | {1})


@torch.inference_mode()
def self_check(gr: GraphRunner, load: Callable[[int], None], eager: Callable[[int], torch.Tensor],
               dtype: torch.dtype, agree: Callable[[float], float] = float) -> float:
    """Replay every captured size against the eager forward on the same inputs; the worst relative error.
    Raises GraphCheckError naming the first size beyond the dtype's tolerance. agree: the worst over the
    tensor-parallel ranks, so they all fail (or pass) together."""
    worst = 0.0
    for rows in gr.capture_sizes:
        load(rows)
        graph = gr.replay(rows).float().clone()
        ref = eager(rows).float()
        err = agree(((graph - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        if not err <= CHECK_TOLERANCE[dtype]:  # NaN fails too
            raise GraphCheckError(f"the CUDA graph of {rows} rows does not reproduce the eager forward (max relative "
                                  f"logit error {err:.3g} > {CHECK_TOLERANCE[dtype]}): a static buffer was replaced "
                                  "or an input is not read from the static buffers; --enforce-eager avoids graphs")
        worst = max(worst, err)
    return worst
