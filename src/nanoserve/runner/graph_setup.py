"""Start-up of the CUDA graphs (decode batch sizes, then prompt / mixed token counts): measure → plan → capture →
self-check.

With cudagraph_capture_sizes="auto" (the CUDA default) a few probe sizes are captured and their replays
timed; runner/bucket_plan.py fits the step-time curve and chooses the sizes that minimise the expected
padded step time over the batch-size distribution (uniform, or the histogram in cudagraph_plan) under
the capture-time and pool budgets; the missing sizes are captured and unused probes dropped. Every
captured size is then replayed once against the eager forward on the same inputs (unless
skip_graph_check): a mismatch beyond the dtype's tolerance fails start-up, naming the size. Token-count graphs
(prefill_graph_sizes="auto") follow the same steps over token counts: probes, a fitted curve, sizes chosen among
multiples of PREFILL_GRAPH_TOKEN_STEP for a uniform token count (the probes kept), each checked on a mixed step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve.config import PREFILL_GRAPH_TOKEN_STEP
from nanoserve.runner.bucket_plan import BatchDistribution, StepCurve, plan_buckets
from nanoserve.runner.cuda_graph import GraphRunner
from nanoserve.runner.timing import time_ms

logger = logging.getLogger("nanoserve")

PROBE_SIZES = (1, 8, 32, 64, 128)  # plus max_num_seqs
TOKEN_PROBE_SIZES = (16, 64, 128, 256, 512, 1024)  # plus the largest token count
TIMED_REPLAYS = 10
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # max |Δ logit| / max |logit|


class GraphCheckError(RuntimeError):
    """A captured graph does not reproduce the eager forward."""


def probe_sizes(max_num_seqs: int) -> list[int]:
    return sorted({s for s in PROBE_SIZES if s < max_num_seqs} | {max_num_seqs})


def token_probe_sizes(max_tokens: int) -> list[int]:
    return sorted({s for s in TOKEN_PROBE_SIZES if s < max_tokens} | {max_tokens})


def plan_tokens(curve: StepCurve, max_tokens: int, capture_budget_s: float, pool_budget_bytes: float) -> list[int]:
    """Token counts for the prompt / mixed graphs (a uniform token count up to max_tokens), plus the probes the curve
    was measured at: they are captured already and share the pool, so keeping them costs nothing, and between
    probes the fitted curve cannot see that a GEMM padded to the next planned size (Llama-3.1-8B: 128 tokens replayed
    at 176) runs slower than the chord says. The largest alone when even the cheapest plan is over the budgets."""
    step = PREFILL_GRAPH_TOKEN_STEP
    try:
        planned = plan_buckets(curve, BatchDistribution.uniform(max_tokens), max_tokens, capture_budget_s,
                               pool_budget_bytes, candidates=range(step, max_tokens + 1, step))
    except ValueError:
        return [max_tokens]
    return sorted(set(planned) | set(curve.rows))


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
    times = sorted(time_ms(lambda: gr.replay(rows), torch.cuda.current_device(), warmup=1, iters=TIMED_REPLAYS))
    return times[len(times) // 2]


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
def self_check(sizes: list[int], pair: Callable[[int], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
               agree: Callable[[float], float] = float, what: str = "CUDA graph of {} rows") -> float:
    """pair(size) → (the replayed logits, the eager forward's on the same inputs) for every captured size; the
    worst relative error. Raises GraphCheckError naming the first size beyond the dtype's tolerance. agree: the
    worst over the tensor-parallel ranks, so they all fail (or pass) together."""
    worst = 0.0
    for size in sizes:
        graph, ref = pair(size)
        err = agree(((graph - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        if not err <= CHECK_TOLERANCE[dtype]:  # NaN fails too
            raise GraphCheckError(f"the {what.format(size)} does not reproduce the eager forward (max relative "
                                  f"logit error {err:.3g} > {CHECK_TOLERANCE[dtype]}): a static buffer was replaced "
                                  "or an input is not read from the static buffers; --enforce-eager avoids graphs")
        worst = max(worst, err)
    return worst
