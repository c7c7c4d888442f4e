"""One decode step on its own, for the benchmarks that time it (`nanoserve bench graphs`, benchmarks/): a
forward-only batch (disjoint_decode_batch, the runner's own probe batch) launched through ModelRunner.execute,
which replays the smallest captured graph of at least its rows, or runs the forward eagerly (enforce_eager, no
CUDA, or more rows than the largest graph). Only the forward and the logits run: nothing is sampled.

Under tensor parallelism (a RunnerGroup) the block tables are written on every rank and execute runs on every
rank, as in a real step.
"""
from __future__ import annotations

from nanoserve.runner.batch import DecodeBatch, disjoint_decode_batch
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


def _write_tables(runner, slots, tables) -> None:  # module level: RunnerGroup pickles it to the workers
    runner.buffers.state.write_tables(slots, tables)


def run_decode_step(runner, batch: DecodeBatch) -> None:
    """Launch the step (graph replay or eager forward, as the engine would run it)."""
    runner.execute(batch)


def time_decode_step(runner, batch: DecodeBatch, warmup: int = 5, iters: int = 30) -> list[float]:
    """ms per step over iters calls after warmup (the package's timing loop: CUDA events, perf_counter on CPU)."""
    return time_ms(lambda: runner.execute(batch), runner.info.device, warmup, iters)


__all__ = ["decode_batch", "run_decode_step", "time_decode_step"]
