"""One decode step on its own, for the benchmarks that time it (`nanoserve bench graphs`, benchmarks/): a
forward-only batch (disjoint_decode_batch, the runner's own probe batch) launched through ModelRunner.execute,
which replays the smallest captured graph of at least its rows, or runs the forward eagerly (enforce_eager, no
CUDA, or more rows than the largest graph). Only the forward and the logits run: nothing is sampled.

Under tensor parallelism (a RunnerGroup) the block tables are written on every rank and execute runs on every
rank, as in a real step.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nanoserve.engine.batching import build_batch
from nanoserve.engine.scheduler import ScheduledStep
from nanoserve.engine.sequence import Sequence
from nanoserve.runner.batch import DecodeBatch, PrefillBatch, SamplingBatch, disjoint_decode_batch
from nanoserve.runner.speculative import DEVICE_DRAFT
from nanoserve.sampling import SamplingParams
from nanoserve.runner.startup.timing import time_ms


def decode_batch(runner, rows: int, context_len: int) -> DecodeBatch:
    """A forward-only decode batch of `rows` rows at context_len tokens each, its block tables written (the
    cache contents are whatever it holds). No request may be running on this runner meanwhile."""
    batch, tables = disjoint_decode_batch(rows, context_len, runner.config.block_size, runner.info.num_kv_blocks)
    on_every_rank = getattr(type(runner), "on_every_rank", None)
    if on_every_rank is None:
        _write_tables(runner, batch.slots, tables)
    else:
        on_every_rank(runner, _write_tables, batch.slots, tables)
    return batch


def greedy_sampling(slots: np.ndarray) -> SamplingBatch:
    """Every row greedy, nothing else (the sampler's plain path)."""
    n = len(slots)
    return SamplingBatch(slots=slots, temperature=np.zeros(n, np.float32), top_p=np.ones(n, np.float32),
                         top_k=np.zeros(n, np.int32), min_p=np.zeros(n, np.float32))


def sampled_decode_batch(runner, rows: int, context_len: int) -> DecodeBatch:
    """decode_batch with greedy sampling: the whole decode step the engine runs (forward, logits, sampler)."""
    batch = decode_batch(runner, rows, context_len)
    return dataclasses.replace(batch, sampling=greedy_sampling(batch.slots))


def verify_batch(runner, rows: int, context_len: int, num_drafts: int, draft_id: int = 0,
                 on_device: bool = False) -> DecodeBatch | PrefillBatch:
    """The step that verifies num_drafts drafts on each of `rows` rows at context_len tokens a row, as the engine
    builds it (engine/batching.py: decode rows of each slot when they fit the largest decode batch, else a token-count
    step), every row sampled greedily and checked against the drafts, over decode_batch's disjoint block tables.
    on_device: the drafts are proposed on the device (a draft model, n-gram), which knows each slot's context_len
    tokens (the rows must fit one decode batch; every run appends the kept tokens there, so time it with
    before=reset_device_tokens(runner, rows, context_len))."""
    decode_batch(runner, rows, context_len + num_drafts)  # writes the tables
    per_row = runner.kv.blocks_for(context_len + num_drafts)
    if on_device:
        reset_device_tokens(runner, rows, context_len)()
        draft_id = DEVICE_DRAFT
    step = ScheduledStep()
    for i in range(rows):
        seq = Sequence(f"verify-{i}", [draft_id] * context_len, SamplingParams(temperature=0.0))
        seq.slot, seq.decoding, seq.num_computed_tokens = i, True, context_len - 1
        seq.block_table = list(range(i * per_row, (i + 1) * per_row))
        seq.num_synced_blocks = per_row
        step.add(seq, 1 + num_drafts, True, [draft_id] * num_drafts)
    return build_batch(step, runner.config.block_size, [], runner.config.max_num_seqs, on_device)


def reset_device_tokens(runner, rows: int, context_len: int):
    """A callable that sets slots 0..rows-1 back to context_len tokens known on the device (one small fill)."""
    hist_len = runner.buffers.state.drafting.hist_len
    return lambda: hist_len[:rows].fill_(context_len)


def _write_tables(runner, slots, tables) -> None:  # module level: RunnerGroup pickles it to the workers
    runner.buffers.state.write_tables(slots, tables)


def run_decode_step(runner, batch: DecodeBatch) -> None:
    """Launch the step (graph replay or eager forward, as the engine would run it)."""
    runner.execute(batch)


def time_decode_step(runner, batch: DecodeBatch, warmup: int = 5, iters: int = 30) -> list[float]:
    """ms per step over iters calls after warmup (the package's timing loop: CUDA events, perf_counter on CPU)."""
    return time_ms(lambda: runner.execute(batch), runner.info.device, warmup, iters)


def time_step(runner, batch, warmup: int = 5, iters: int = 30, before=None) -> list[float]:
    """ms per step (launch + sampled tokens read back) over iters calls after warmup (the package's timing loop);
    before: called ahead of each step, inside the timing (reset_device_tokens)."""
    def step():
        if before is not None:
            before()
        handle = runner.execute(batch)
        if handle is not None:
            handle.result()
    return time_ms(step, runner.info.device, warmup, iters)


__all__ = ["decode_batch", "run_decode_step", "time_decode_step", "sampled_decode_batch", "verify_batch", "time_step",
           "greedy_sampling", "reset_device_tokens"]
