"""What the engine core reads of a runner: one record at start-up and live step counters, the same for one rank
(ModelRunner) and a tensor-parallel group (RunnerGroup: rank 0's, which runs every step the others do)."""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.runner.startup.bucket_plan import StepCurve


@dataclass(frozen=True)
class RunnerInfo:
    vocab_size: int
    device: str  # the (rank 0) device the runner samples on, e.g. "cuda:0"
    num_kv_blocks: int
    kv_block_bytes: int  # one block's bytes over every layer (this rank's heads), an fp8 cache's scales and a draft
    # model's cache (the same blocks: runner/draft_model.py) included
    kv_cache_dtype: str  # the cache's element type: "bfloat16", "float8_e4m3fn", ...
    kv_cache_scales: str | None  # an fp8 cache's scale design, "token" or "layer"; None for a serving-dtype cache
    decode_graph_sizes: tuple[int, ...]  # batch sizes with a CUDA graph ((): decode runs eagerly)
    token_graph_sizes: tuple[int, ...]  # token counts of prompt / mixed steps with a graph
    step_curve: StepCurve | None  # decode step ms against rows, measured at start-up ("auto" graphs)
    token_curve: StepCurve | None  # prompt / mixed step ms against tokens, likewise
    draft_curve: StepCurve | None = None  # a draft model's decode step (it proposes) ms against rows, likewise
    # a verification's step ms against rows (the graphs it replays: the draft model's, or the decode graphs), its rows
    # in sequences of 1 + num_speculative_tokens (engine/draft_plan.VerifyCost), likewise
    verify_curve: StepCurve | None = None


@dataclass
class RunnerCounters:
    """Steps by how they ran, and the padding the graphs added (the server's /metrics)."""

    decode_steps_graph: int = 0
    decode_steps_eager: int = 0
    prefill_steps_graph: int = 0
    prefill_steps_eager: int = 0
    padding_rows: int = 0
    padding_tokens: int = 0


__all__ = ["RunnerInfo", "RunnerCounters"]
