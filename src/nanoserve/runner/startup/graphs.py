"""Start-up of the CUDA graphs (decode batch sizes and their sampler, then prompt / mixed token counts): measure →
plan → capture, into the one GraphTable (runner/dispatch.py) the step path routes through.

With cudagraph_capture_sizes="auto" (the CUDA default) a few probe sizes are captured and their replays
timed; bucket_plan.py fits the step-time curve and chooses the sizes that minimise the expected
padded step time over the batch-size distribution (uniform, or the histogram in cudagraph_plan) under
the capture-time and pool budgets; the missing sizes are captured and unused probes dropped. Every
captured size is then replayed once against the eager forward on the same inputs (self_check.py). Token-count graphs
(prefill_graph_sizes="auto") follow the same steps over token counts: probes, a fitted curve, sizes chosen among
multiples of PREFILL_GRAPH_TOKEN_STEP for a uniform token count (the probes kept). Under tensor parallelism every
rank captures rank 0's plan.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve.config import PREFILL_GRAPH_TOKEN_STEP, EngineConfig
from nanoserve.runner.buffers import StepBuffers
from nanoserve.runner.cuda_graph import GraphRunner
from nanoserve.runner.dispatch import GraphTable, Kind
from nanoserve.runner.startup.bucket_plan import BatchDistribution, StepCurve, plan_buckets
from nanoserve.runner.startup.probes import Probes
from nanoserve.runner.startup.timing import time_ms

logger = logging.getLogger("nanoserve")

PROBE_SIZES = (1, 8, 32, 64, 128)  # plus max_num_seqs
TOKEN_PROBE_SIZES = (16, 64, 128, 256, 512, 1024)  # plus the largest token count
TIMED_REPLAYS = 10


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


def measure_curve(gr: GraphRunner, load: Callable[[int], object], sizes: list[int]) -> StepCurve:
    """Capture the probe sizes and time their replays (loaded with `load(rows)`): the fitted StepCurve."""
    gr.capture(sizes)
    step_ms = {rows: _replay_ms(gr, load, rows) for rows in sizes}
    largest = max(sizes)
    extra_seconds = {r: gr.capture_times[r] for r in sizes if r != largest}
    extra_bytes = {r: gr.pool_growth[r] for r in sizes if r != largest}
    return StepCurve.fit(step_ms, {largest: gr.capture_times[largest]}, {largest: gr.pool_growth[largest]},
                         extra_seconds or None, extra_bytes or None)


def _replay_ms(gr: GraphRunner, load: Callable[[int], object], rows: int) -> float:
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


def capture_decode(table: GraphTable, buffers: StepBuffers, probes: Probes, config: EngineConfig,
                   tp) -> StepCurve | None:
    """The decode graphs (planned for "auto" from measured probes, rank 0's plan on every rank); speculating, the
    verification's at the same sizes (Kind.VERIFY: a sequence's rows read as one attention group; not with a draft
    model, whose every verification also proposes: Kind.DRAFT, capture_draft); then their sampler's. The measured
    step curve ("auto") or None."""
    fwd = buffers.decode_forward
    gr = GraphRunner(fwd.captured, fwd.prepare_padding)
    sizes, curve = list(config.cudagraph_capture_sizes.sizes), None
    if config.cudagraph_capture_sizes.planned:
        probed = probe_sizes(config.max_num_seqs)
        curve = measure_curve(gr, probes.load_decode, probed)
        share = 0.5 if config.prefill_graph_sizes.planned else 1.0  # the token-count graphs plan in the rest
        budget_s, pool = share * config.cudagraph_capture_budget_s, share * config.cudagraph_pool_budget_mib * 2**20
        planned = plan(curve, config.max_num_seqs, config.cudagraph_plan, budget_s, pool) if tp.rank == 0 else []
        sizes = tp.broadcast_ints(planned, config.max_num_seqs)  # every rank captures rank 0's plan
        gr.drop(set(probed) - set(sizes))
    gr.capture(sizes, config.show_progress)
    table.add(Kind.DECODE, gr)
    if fwd.seq_rows > 1 and buffers.state.draft_model is None:
        verify = GraphRunner(functools.partial(fwd.captured, verify=True), fwd.prepare_padding, pool=gr.pool)
        verify.capture(gr.capture_sizes)
        table.add(Kind.VERIFY, verify)
    if buffers.sampler.fuses:
        _capture_sampler(table, buffers, gr)
    return curve


def capture_draft(table: GraphTable, buffers: StepBuffers, probes: Probes, planned: bool) -> StepCurve | None:
    """A draft model's decode graphs (Kind.DRAFT: the decode sizes, into their pool), and when the decode sizes were
    planned the step curve of their replays, which the draft plan weighs a verification by (engine/draft_plan.py)."""
    fwd, decode = buffers.decode_forward, table.runners[Kind.DECODE]
    gr = GraphRunner(functools.partial(fwd.captured, propose=True), fwd.prepare_padding, pool=table.pool)
    gr.capture(decode.capture_sizes)
    table.add(Kind.DRAFT, gr)
    if not planned:
        return None
    return StepCurve.fit({rows: _replay_ms(gr, probes.load_decode, rows) for rows in gr.capture_sizes})


def measure_verify(gr: GraphRunner, probes: Probes, max_num_seqs: int) -> StepCurve:
    """The verification curve (engine/draft_plan.VerifyCost's grouped one): replays of the graphs a verification runs,
    its rows in sequences of 1 + num_speculative_tokens (Probes.load_verify), at the captured size nearest above each
    probe size."""
    sizes = {min((s for s in gr.capture_sizes if s >= p), default=max(gr.capture_sizes))
             for p in probe_sizes(max_num_seqs)}
    return StepCurve.fit({rows: _replay_ms(gr, probes.load_verify, rows) for rows in sorted(sizes)})


def _capture_sampler(table: GraphTable, buffers: StepBuffers, decode: GraphRunner) -> None:
    """The plain sample of each decode bucket, unmasked and masked, into the decode graphs' pool: one replay
    instead of a Triton launch after the decode graph's (less host time: notes/PERF.md, round 4); speculating, also
    the sample of a verification (its stores and packing: ~5 launches a verifying step at b = 1, where the loop is
    bound by the host)."""
    fwd, pool, sampler = buffers.decode_forward, decode.pool, buffers.sampler
    inputs = lambda rows: (fwd.inputs.views(rows).temperature, fwd.inputs.views(rows).slots)  # noqa: E731
    last = buffers.state.last_tokens
    graphs = {Kind.SAMPLE: sampler.plain_forward(fwd.static_logits, inputs, last, False),
              Kind.SAMPLE_MASKED: sampler.plain_forward(fwd.static_logits, inputs, last, True)}
    if fwd.seq_rows > 1:
        graphs[Kind.SAMPLE_VERIFY] = sampler.verify_forward(fwd.static_logits, fwd.inputs.views, last,
                                                            buffers.state.drafting)
    for kind, forward in graphs.items():
        gr = GraphRunner(forward, fwd.prepare_padding, pool)
        gr.capture(decode.capture_sizes)
        table.add(kind, gr)
        pool = gr.pool


def capture_tokens(table: GraphTable, buffers: StepBuffers, probes: Probes, config: EngineConfig,
                   tp) -> StepCurve | None:
    """Token-count graphs of prompt / mixed steps into the decode graphs' pool (planned within what they left of the
    budgets, for "auto"); the measured curve ("auto") or None. Without CUDA, given sizes run uncaptured."""
    fwd, largest = buffers.token_forward, config.prefill_graph_sizes.largest
    gr = GraphRunner(fwd.captured, fwd.prepare_padding, pool=table.pool, record=buffers.kv_cache.is_cuda)
    sizes, curve = list(config.prefill_graph_sizes.sizes), None
    if config.prefill_graph_sizes.planned:
        probed = token_probe_sizes(largest)
        curve = measure_curve(gr, probes.load_mixed, probed)
        decode = [table.runners[k] for k in (Kind.DECODE, Kind.VERIFY, Kind.DRAFT) if k in table.runners]
        spent = sum(r.capture_seconds for r in decode)  # the budgets' share the decode graphs took
        used = sum(r.pool_bytes for r in decode)
        planned = plan_tokens(curve, largest, config.cudagraph_capture_budget_s - spent,
                              config.cudagraph_pool_budget_mib * 2**20 - used)
        sizes = tp.broadcast_ints(planned if tp.rank == 0 else [], largest)
        gr.drop(set(probed) - set(sizes))
    gr.capture(sizes, config.show_progress)
    table.add(Kind.TOKENS, gr)
    return curve
