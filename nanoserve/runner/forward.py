"""The two forwards a step runs: decode over device-resident inputs (what the graphs capture) and the
eager prefill / mixed forward. Both take their input ids on the device where the host does not know
them (a slot's last sampled token), and patch the persistent block table first."""
from __future__ import annotations

import numpy as np
import torch

from nanoserve.kernels.metadata import AttentionMetadata
from nanoserve.kernels.step_inputs import prepare_decode
from nanoserve.runner.batch import DecodeBatch, PrefillBatch
from nanoserve.runner import prompt_logprobs
from nanoserve.runner.inputs import DecodeInputs, PersistentState, StepPacker, sampling_arrays, updates_arrays
from nanoserve.runner.sampler import SamplingTensors


class DecodeForward:
    """rows → logits [rows, vocab] from the DecodeInputs region of `rows` rows; graph-capturable.

    `captured(rows)` is what the graphs record: the same forward writing into one static logits buffer shared by
    every graph, so the graph pool holds each graph's intermediates only (reused between graphs), not a
    [rows, vocab] output per graph — which would make the pool grow with the sum of all captured sizes."""

    def __init__(self, model, state: PersistentState, inputs: DecodeInputs):
        self.model, self.state, self.inputs = model, state, inputs
        self.static_logits: torch.Tensor | None = None  # made by the first warm-up, before any capture

    def captured(self, rows: int) -> torch.Tensor:
        if self.static_logits is None:
            self.static_logits = torch.empty(self.inputs.max_rows, self.model.vocab_size, dtype=self.model.dtype,
                                             device=self.state.block_tables.device)
        out = self.static_logits[:rows]
        out.copy_(self(rows))
        return out

    def __call__(self, rows: int, width: int | None = None) -> torch.Tensor:
        """width: block-table columns to gather (eager callers pass the batch's widest table; graphs all)."""
        v = self.inputs.views(rows)
        input_ids, tables = prepare_decode(v.slots, v.new_block_cols, v.new_block_ids, self.state.last_tokens,
                                           self.state.block_tables, width)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=v.slot_mapping, context_lens=v.context_lens,
                                 block_tables=tables)
        hidden = self.model(input_ids, v.positions, meta)
        return self.model.compute_logits(hidden)

    def prepare_padding(self, rows: int) -> None:
        """Load an all-padding batch of `rows` rows (warm-up and capture)."""
        empty = np.zeros(0, np.int32)
        self.inputs.load(DecodeBatch(empty, empty, empty, empty, empty, empty, None), rows)


class PrefillForward:
    """Eager forward of prompt chunks (and decode rows riding along); logits of the sampled rows only."""

    def __init__(self, model, state: PersistentState, packer: StepPacker, logprob_chunk: int = 256):
        self.model, self.state, self.packer = model, state, packer
        self.logprob_chunk = logprob_chunk  # rows of prompt-logprob logits at once

    def __call__(self, batch: PrefillBatch) -> tuple[torch.Tensor, SamplingTensors | None, torch.Tensor,
                                                      prompt_logprobs.PromptLogprobsHandle | None]:
        """(logits [n, vocab], the sampled rows' parameters on the device, their slots on the device, the
        prompt logprobs asked for, on their way to the host)."""
        s = len(batch.slots)
        positions = _chunk_positions(batch.starts, batch.query_lens)
        token_slots = np.repeat(batch.slots, batch.query_lens)
        cu_q = np.zeros(s + 1, np.int32)
        np.cumsum(batch.query_lens, out=cu_q[1:])
        context_lens = (batch.starts + batch.query_lens).astype(np.int32)
        sample_token_rows = (cu_q[1:][batch.sample_rows] - 1).astype(np.int32)
        sampled_slots = batch.slots[batch.sample_rows]
        sampling = sampling_arrays(batch.sampling) if batch.sampling is not None else []
        dev = self.packer.pack([batch.token_ids, positions, batch.slot_mapping, token_slots, batch.slots, cu_q,
                                context_lens, sample_token_rows, sampled_slots,
                                *updates_arrays(batch.block_updates), *sampling,
                                batch.prompt_logprob_rows, batch.prompt_logprob_targets])
        (ids, pos, slot_mapping, tok_slots, slots, cu_q_d, ctx_d, rows_d, sampled_slots_d, us, uc, ub) = dev[:12]
        self.state.apply(us, uc, ub)
        ids = torch.where(ids >= 0, ids, self.state.last_tokens[tok_slots.long()])
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slot_mapping, context_lens=ctx_d,
            block_tables=self.state.block_tables[slots.long(), :batch.max_blocks],
            cu_seqlens_q=cu_q_d, max_seqlen_q=int(batch.query_lens.max()), max_seqlen_k=int(context_lens.max()),
            has_cached_prefix=batch.has_cached_context, query_lens_host=batch.query_lens.tolist(),
            context_lens_host=context_lens.tolist())
        hidden = self.model(ids, pos, meta)
        logits = self.model.compute_logits(hidden[rows_d.long()])
        params = SamplingTensors(*dev[12:16]) if batch.sampling is not None else None
        prompt = None
        if len(batch.prompt_logprob_rows):
            packed = prompt_logprobs.compute(self.model, hidden, dev[-2], dev[-1], batch.prompt_logprob_k,
                                             self.logprob_chunk)
            prompt = prompt_logprobs.PromptLogprobsHandle(packed, len(batch.prompt_logprob_rows))
        return logits, params, sampled_slots_d, prompt


def _chunk_positions(starts: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    """Concatenated arange(start, start + len) per sequence, vectorised."""
    total = int(query_lens.sum())
    offsets = np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    return (np.arange(total, dtype=np.int64) - offsets + np.repeat(starts, query_lens)).astype(np.int32)
