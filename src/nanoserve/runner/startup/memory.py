"""The start-up memory plan: how many KV blocks fit once weights, activations and graphs have their share.

Measured, not estimated: a probe runs the largest eager step (a full token budget of prefill, then the
sampler on max_num_seqs rows with every option on) and captures the largest decode graph, over the runner's
own buffers (runner/buffers.py) on a probe-sized cache, dropped afterwards; the peaks and the graph pool are subtracted from
gpu_memory_utilization × total memory.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import MAX_LOGPROBS, EngineConfig
from nanoserve.kernels.paging import kv_slots
from nanoserve.runner.batch import BlockUpdates, PrefillBatch, SamplingBatch
from nanoserve.runner.buffers import StepBuffers
from nanoserve.runner.cuda_graph import GraphRunner
from nanoserve.runner.forward import TokenForward
from nanoserve.runner.kv_cache import KVCacheSpec
from nanoserve.runner.sampler import SamplingTensors

logger = logging.getLogger("nanoserve")


@dataclass
class MemoryPlan:
    num_kv_blocks: int
    activation_bytes: int = 0
    graph_bytes: int = 0


def plan_memory(model, config: EngineConfig, kv: KVCacheSpec, draft: tuple | None = None) -> MemoryPlan:
    """Explicit num_kv_blocks, the CPU budget, or what the GPU has left after the probes. draft: (a draft model, its
    KVCacheSpec): a block holds its KV too, and its forwards run in the probes."""
    if config.num_kv_blocks is not None:
        return MemoryPlan(config.num_kv_blocks)
    max_blocks = kv.blocks_for(config.max_model_len)
    block_bytes = kv.block_bytes + (draft[1].block_bytes if draft is not None else 0)
    tails = kv.tail_bytes + (draft[1].tail_bytes if draft is not None else 0)  # fixed, beside the blocks
    if config.torch_device.type != "cuda":  # cpu_kv_cache_gb, but no more than max_num_seqs full sequences use
        most_needed = config.max_num_seqs * max_blocks
        return MemoryPlan(max(min(int(config.cpu_kv_cache_gb * 2**30 - tails) // block_bytes, most_needed), 1))
    activation, graphs = _probe(model, config, kv, draft)
    free, total = torch.cuda.mem_get_info()
    in_use = total - free  # weights, CUDA context, allocator cache
    budget = total * config.gpu_memory_utilization - in_use - activation - graphs - tails
    num_blocks = int(budget // block_bytes)
    if num_blocks <= 0:
        raise ValueError(f"no memory left for the KV cache: {total / 2**30:.1f} GiB × gpu_memory_utilization "
                         f"{config.gpu_memory_utilization} minus weights/activations/graphs is {budget / 2**30:.2f} GiB")
    logger.info("memory plan: activation peak %.0f MiB, graph pool %.0f MiB, KV cache %.0f MiB (%d blocks)%s",
                activation / 2**20, graphs / 2**20, num_blocks * block_bytes / 2**20, num_blocks,
                f" and its exact tail {tails / 2**20:.0f} MiB" if tails else "")
    return MemoryPlan(num_blocks, activation, graphs)


@torch.inference_mode()
def _probe(model, config: EngineConfig, kv: KVCacheSpec, draft: tuple | None) -> tuple[int, int]:
    """(activation peak, graph pool + static buffers) in bytes, measured over the runner's own buffers
    (StepBuffers, as ModelRunner wires them) on a cache of one full token budget."""
    device = config.torch_device
    budget = config.max_num_batched_tokens
    seq_len = min(config.max_model_len, budget)
    num_seqs = max(min(budget // seq_len, config.max_num_seqs), 1)
    per_seq = kv.blocks_for(seq_len)
    buffers = StepBuffers.build(model, config, kv, num_seqs * per_seq, device, draft=draft)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _probe_prefill(buffers.token_forward, num_seqs, seq_len, per_seq, kv.block_size)
    _probe_sampler(buffers, config.max_num_seqs, model.vocab_size, config.torch_dtype, device)
    torch.cuda.synchronize()
    activation = torch.cuda.max_memory_allocated() - base
    graphs = _probe_graphs(buffers, config) + buffers.static_bytes()
    kv.release(model)
    if draft is not None:
        kv.release(draft[0])
    del buffers
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return activation, graphs


def _probe_graphs(buffers: StepBuffers, config: EngineConfig) -> int:
    """Bytes of graph pool the largest decode graph and the largest token-count graph take (one pool)."""
    probes = []
    largest = config.cudagraph_capture_sizes.largest
    if largest:
        forward = buffers.decode_forward  # (with a draft model, its decode graphs: the larger)
        captured = functools.partial(forward.captured, propose=buffers.state.draft_model is not None)
        probes.append(GraphRunner(captured, forward.prepare_padding))
        probes[-1].capture([largest])
    tokens = config.prefill_graph_sizes.largest
    if tokens:
        forward = buffers.token_forward
        # the decode probe stays alive meanwhile: a pool is freed with its last graph
        probes.append(GraphRunner(forward.captured, forward.prepare_padding, pool=probes[0].pool if probes else None))
        probes[-1].capture([tokens])
    return sum(p.pool_bytes for p in probes)


def _probe_prefill(forward: TokenForward, num_seqs: int, seq_len: int, per_seq: int, block_size: int) -> None:
    """A full token budget of prefill in two chunks: the first fresh (flash varlen), the second over the cached
    first half (the paged kernel that chunked prefill, prefix hits and mixed steps use): both peak, both compiled."""
    slots = np.arange(num_seqs, dtype=np.int32)
    tables = np.arange(num_seqs * per_seq, dtype=np.int32).reshape(num_seqs, per_seq)
    half = max(seq_len // 2, 1)
    for start, end in ((0, half), (half, seq_len)):
        if end <= start:
            continue
        slot_mapping = kv_slots(tables, np.arange(start, end), block_size).reshape(-1)  # row after row
        cols = np.tile(np.arange(per_seq, dtype=np.int32), num_seqs)
        updates = BlockUpdates(np.repeat(slots, per_seq), cols, tables.reshape(-1))
        batch = PrefillBatch(slots, np.full(num_seqs, start, np.int32), np.full(num_seqs, end - start, np.int32),
                             np.ones(num_seqs * (end - start), np.int32), slot_mapping, updates, slots.copy(), None,
                             per_seq)
        forward(batch)


def _probe_sampler(buffers: StepBuffers, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """The sampler's worst case: every row sampled with top-p / top-k and full logprobs."""
    logits = torch.randn(rows, vocab, dtype=dtype, device=device)
    n = np.full(rows, 1, np.float32)
    batch = SamplingBatch(np.arange(rows, dtype=np.int32), n * 0.7, n * 0.9, np.full(rows, 50, np.int32), n * 0.01,
                          num_logprobs=[MAX_LOGPROBS] * rows)
    params = SamplingTensors(*(torch.from_numpy(a).to(device) for a in
                               (batch.temperature, batch.top_p, batch.top_k, batch.min_p)))
    slots = torch.arange(rows, dtype=torch.int32, device=device)
    buffers.sampler(logits, batch, params, buffers.state.last_tokens, slots).result()
