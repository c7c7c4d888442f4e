"""A runner's start-up, in its own room: load the model → plan memory → allocate the KV cache and the step buffers →
capture the decode graphs (and their sampler's), then the token-count graphs → self-check every graph → one log
line each. What it returns (Started) is all the step path (runner/model_runner.py) runs on.

Under tensor parallelism (tp: this rank's place in the group) every rank makes the same calls in the same order:
the ranks agree on the smallest KV block count, rank 0 plans the "auto" graph sizes for all, and every random draw
(probe inputs, unseeded sampling) comes from the runner's own generators, seeded alike on every rank.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.model.communicator import TensorParallel
from nanoserve.model.loader import load_model
from nanoserve.model_files import load_draft_hf_config
from nanoserve.runner.buffers import StepBuffers
from nanoserve.runner.dispatch import GraphTable, Kind
from nanoserve.runner.kv_cache import KVCacheSpec
from nanoserve.runner.startup import graphs
from nanoserve.runner.startup.bucket_plan import StepCurve
from nanoserve.runner.startup.kv_scales import resolve_kv_scales
from nanoserve.runner.startup.memory import plan_memory
from nanoserve.runner.startup.probes import Probes
from nanoserve.runner.startup.self_check import self_check

logger = logging.getLogger("nanoserve")


@dataclass
class Started:
    model: object
    kv: KVCacheSpec
    num_kv_blocks: int
    buffers: StepBuffers
    graphs: GraphTable
    step_curve: StepCurve | None
    token_curve: StepCurve | None
    draft_curve: StepCurve | None  # a draft model's decode graphs (Kind.DRAFT) against rows, likewise
    verify_curve: StepCurve | None  # the graphs a verification replays, rows grouped by sequence, likewise
    block_bytes: int  # one KV block's bytes, the draft model's share included


def start(config: EngineConfig, hf_config, tp: TensorParallel, rng: torch.Generator) -> Started:
    """rng: the runner's device generator (probe inputs, then unseeded sampling)."""
    host_rng = torch.Generator().manual_seed(config.seed)  # self-check context lengths, probe prompt ids
    model = load_model(config.model, hf_config, config.torch_dtype, config.torch_device, config.load_format, tp,
                       quantization=config.quantization, quantize_lm_head=config.quantize_lm_head,
                       progress=config.show_progress and tp.rank == 0, max_model_len=config.max_model_len)
    kv = KVCacheSpec.of(model, config.block_size, config.kv_torch_dtype, resolve_kv_scales(config, model),
                        config.max_num_seqs)
    draft = _load_draft(config, tp)
    num_blocks = tp.min_int(plan_memory(model, config, kv, draft).num_kv_blocks)  # every rank's cache holds it
    if num_blocks * config.block_size < config.max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * config.block_size} tokens ({num_blocks} blocks), fewer than "
            f"max_model_len={config.max_model_len}; lower max_model_len or give the cache more memory")
    buffers = StepBuffers.build(model, config, kv, num_blocks, config.torch_device, rng, draft)
    _warm_up_logits(model, config)
    probes = Probes(buffers, config, kv, num_blocks, model.vocab_size, rng, host_rng)
    table, step_curve, token_curve, draft_curve, verify_curve = GraphTable(), None, None, None, None
    if config.cudagraph_capture_sizes:
        step_curve = graphs.capture_decode(table, buffers, probes, config, tp)
        if draft is not None:
            draft_curve = graphs.capture_draft(table, buffers, probes, step_curve is not None)
        if step_curve is not None and buffers.decode_forward.seq_rows > 1:
            verify_curve = graphs.measure_verify(table.runners[Kind.DRAFT if draft is not None else Kind.VERIFY],
                                                 probes, config.max_num_seqs)
    if config.prefill_graph_sizes:
        token_curve = graphs.capture_tokens(table, buffers, probes, config, tp)
    check = None if config.skip_graph_check else self_check(table, buffers, probes, config.torch_dtype, tp.max_float)
    _log(config, table, num_blocks, check, planned=step_curve is not None)
    block_bytes = kv.block_bytes + (draft[1].block_bytes if draft is not None else 0)
    return Started(model, kv, num_blocks, buffers, table, step_curve, token_curve, draft_curve, verify_curve,
                   block_bytes)


def _load_draft(config: EngineConfig, tp: TensorParallel) -> tuple | None:
    """(the draft model, its KVCacheSpec) when speculative_config names one (runner/draft_model.py), else None. It
    loads like the model (dtype, device, load_format), with the model's KV cache dtype."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    hf_config = load_draft_hf_config(spec.model)
    draft = load_model(spec.model, hf_config, config.torch_dtype, config.torch_device, config.load_format, tp,
                       progress=config.show_progress and tp.rank == 0, max_model_len=config.max_model_len)
    return draft, KVCacheSpec.of(draft, config.block_size, config.kv_torch_dtype, resolve_kv_scales(config, draft),
                                 config.max_num_seqs)


@torch.inference_mode()
def _warm_up_logits(model, config: EngineConfig) -> None:
    """Compile the lm_head product for every row bucket a step may sample (prefill steps sample any count)."""
    if config.torch_device.type != "cuda":
        return
    rows = 1
    while rows <= min(config.max_num_seqs, 64) * 2:
        model.compute_logits(torch.zeros(rows, model.hidden_size, dtype=config.torch_dtype,
                                         device=config.torch_device))
        rows *= 2
    torch.cuda.synchronize()


def _log(config: EngineConfig, table: GraphTable, num_blocks: int, check: dict | None, planned: bool) -> None:
    """One line for the decode graphs (or why there are none), one for the token-count graphs."""
    def checked(kinds) -> str:
        if check is None:
            return "skipped"
        errors = [check[k] for k in kinds if k in check]
        return f"every graph equals eager (max relative logit error {max(errors, default=0.0):.1e})"
    decode = table.runners.get(Kind.DECODE)
    if decode is None:
        why = "enforce_eager" if config.enforce_eager else "no CUDA device"
        logger.info("decode runs eagerly (%s); %d KV blocks of %d tokens", why, num_blocks, config.block_size)
    else:
        more = (Kind.VERIFY, Kind.DRAFT, Kind.SAMPLE, Kind.SAMPLE_MASKED, Kind.SAMPLE_VERIFY)
        others = sum(table.runners[k].wall_seconds for k in more if k in table.runners)
        logger.info("CUDA graphs: %d sizes %s (%s); capture %.2f s (%.2f s with probes and compilation; the "
                    "verification, draft and sampler graphs' %.2f s); pool %.0f MiB; %d KV blocks; self-check: %s",
                    len(decode.capture_sizes), decode.capture_sizes,
                    "planned from measured replays" if planned else "as configured", decode.capture_seconds,
                    decode.wall_seconds, others, decode.pool_bytes / 2**20, num_blocks, checked((Kind.DECODE, *more)))
    tokens = table.runners.get(Kind.TOKENS)
    if tokens is not None:
        logger.info("CUDA graphs for prompt / mixed steps: %d token counts %s; capture %.2f s; pool %.0f MiB in all; "
                    "self-check: %s", len(tokens.capture_sizes), tokens.capture_sizes, tokens.capture_seconds,
                    table.pool_bytes / 2**20, checked((Kind.TOKENS,)))


__all__ = ["start", "Started"]
