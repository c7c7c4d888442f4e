"""The two forwards a step runs: decode over device-resident inputs (what the batch-size graphs capture) and
the prompt / mixed forward (eager at its own size, or over static inputs that the token-count graphs capture).
Both take their input ids on the device where the host does not know them (a slot's last sampled token), and
patch the persistent block table first. Each reads its inputs by name from a typed record (runner/inputs.py)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from nanoserve.kernels.attention import prefill_q_per_tile
from nanoserve.kernels.step_inputs import DEVICE_DRAFT, DecodeTail, DeviceRows, prepare_decode
from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.runner import prompt_logprobs
from nanoserve.runner.batch import BlockUpdates, DecodeBatch, PrefillBatch
from nanoserve.runner.speculative import VerifyRows
from nanoserve.runner.inputs import (DecodeInputs, PersistentState, StepPacker, StepTail, TokenInputs, TokenViews,
                                     decode_values, token_values)


class DecodeForward:
    """rows → logits [rows, vocab] from the DecodeInputs region of `rows` rows; graph-capturable.

    `captured(rows)` is what the graphs record: the same forward writing into one static logits buffer shared by
    every graph, so the graph pool holds each graph's intermediates only (reused between graphs), not a
    [rows, vocab] output per graph — which would make the pool grow with the sum of all captured sizes.

    seq_rows: the most rows one sequence runs (1 + num_speculative_tokens when speculating): a verifying forward
    (`verify`, or a draft model's `propose`) reads each sequence's keys once for all its rows
    (AttentionMetadata.seq_rows); a plain one reads row by row, with the narrower query tile of one row."""

    def __init__(self, model, state: PersistentState, inputs: DecodeInputs, seq_rows: int = 1):
        self.model, self.state, self.inputs, self.seq_rows = model, state, inputs, seq_rows
        self.static_logits: torch.Tensor | None = None  # made by the first warm-up, before any capture

    def load(self, batch: DecodeBatch, rows: int) -> None:
        """The batch into the region of `rows` ≥ its size (the rest is padding)."""
        if batch.group_back is not None and len(batch.group_back) and int(batch.group_back.max()) >= self.seq_rows:
            raise ValueError(f"a decode batch runs {int(batch.group_back.max()) + 1} rows of one sequence; this "
                             f"runner's graphs take at most {self.seq_rows} (1 + num_speculative_tokens)")
        self.inputs.load(decode_values(batch), rows)

    def captured(self, rows: int, propose: bool = False, verify: bool = False) -> torch.Tensor:
        if self.static_logits is None:
            self.static_logits = torch.empty(self.inputs.max_rows, self.model.vocab_size, dtype=self.model.dtype,
                                             device=self.state.block_tables.device)
        out = self.static_logits[:rows]
        out.copy_(self(rows, propose=propose, verify=verify))
        return out

    def __call__(self, rows: int, width: int | None = None, propose: bool = False,
                 verify: bool = False) -> torch.Tensor:
        """width: block-table columns to gather (eager callers pass the batch's widest table; graphs all); propose:
        the draft model proposes the drafts of the rows that ask for them (Kind.DRAFT); verify: the rows verify
        drafts (Kind.VERIFY): a sequence's rows are one attention group."""
        v = self.inputs.views(rows)
        drafting, draft, device = self.state.drafting, self.state.draft_model, None
        if drafting is not None:  # positions and drafts from the device (runner/speculative.DraftState)
            # (a draft model proposes once the rows are resolved, below: none resolved here)
            drafts, counts = drafting.propose(v.draft_slots) if draft is None else (draft.no_drafts[:rows],
                                                                                    draft.no_counts[:rows])
            device = DeviceRows(v.from_device, drafting.hist_len, v.positions, v.slot_mapping, v.context_lens,
                                v.draft_ids, drafts, counts, drafting.block_size)
        bs = self.state.tail_block_size  # an fp8 cache's tail: prepare_decode writes each row's tail row
        tail = DecodeTail(v.positions, v.tail_rows, bs) if bs is not None else None
        input_ids, tables = prepare_decode(v.slots, v.new_block_cols, v.new_block_ids, self.state.last_tokens,
                                           self.state.block_tables, width, v.token_ids, v.group_back, device, tail)
        if draft is not None and propose:
            input_ids = draft.propose(input_ids, tables, v.slots, v.positions, v.slot_mapping, v.context_lens,
                                      v.token_ids == DEVICE_DRAFT, v.draft_ids, v.group_back, v.draft_slots >= 0,
                                      v.temperature, v.draft_sampled > 0)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=v.slot_mapping, context_lens=v.context_lens,
                                 block_tables=tables, seq_rows=self.seq_rows if propose or verify else 1,
                                 group_back=v.group_back,
                                 **({} if tail is None else {"table_rows": v.slots, "tail_rows": v.tail_rows}))
        hidden = self.model(input_ids, v.positions, meta)
        if draft is not None:
            draft.mirror(input_ids, v.positions, meta)
        return self.model.compute_logits(hidden)

    def prepare_padding(self, rows: int) -> None:
        """Load an all-padding batch of `rows` rows (warm-up and capture)."""
        self.inputs.load({}, rows)


class TokenForward:
    """Prompt and mixed steps (prompt chunks, decode rows riding along): the eager forward of a PrefillBatch at its
    own size, and the same model forward over the static TokenInputs of T tokens that the token-count graphs
    capture (`captured(T)` writes one static hidden-state buffer shared by every size). The logits of the sampled
    rows are computed after the forward either way, eagerly: their count varies step to step."""

    def __init__(self, model, state: PersistentState, packer: StepPacker, inputs: TokenInputs | None = None,
                 logprob_chunk: int = 256, q_per_tile: int | None = None):
        """q_per_tile: the work list's tile (q_per_tile_of), when a draft model shares it."""
        self.model, self.state, self.packer, self.inputs = model, state, packer, inputs
        self.logprob_chunk = logprob_chunk  # rows of prompt-logprob logits at once
        self.q_per_tile = q_per_tile or self.q_per_tile_of(model)
        self.static_hidden: torch.Tensor | None = None

    @staticmethod
    def q_per_tile_of(*models) -> int:
        """The attention work list's tile (kernels.attention.prefill_q_per_tile) for these models' layers: the
        smallest, when a draft model mirrors the step (a kernel whose tiles hold more tokens than the list's step
        computes the overlap twice, alike; one whose tiles hold fewer would skip tokens)."""
        def tile(model) -> int:
            attn = model.attention_layers()[0]
            return prefill_q_per_tile(attn.num_heads, attn.num_kv_heads, attn.head_dim, model.dtype.itemsize)
        return min(map(tile, models))

    def arrays(self, batch: PrefillBatch) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The step's host arrays (inputs.token_values), for load() or the eager forward."""
        return token_values(batch, self.q_per_tile, self.state.tail_block_size)

    def __call__(self, batch: PrefillBatch, arrays=None):
        """The eager forward: (logits [n, vocab], the sampled rows' parameters on the device, their slots on the
        device, the prompt logprobs asked for, on their way to the host)."""
        arrays = arrays or self.arrays(batch)
        static, tail = self.packer.pack(*arrays)
        self.state.apply(tail)
        self._device_drafts(static, tail, arrays[1]["draft_ids"])
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=static.slot_mapping, context_lens=static.context_lens,
            block_tables=self.state.block_tables, table_rows=static.slots, cu_seqlens_q=static.cu_seqlens_q,
            max_seqlen_q=int(batch.query_lens.max()), has_cached_prefix=batch.has_cached_context,
            query_lens_host=batch.query_lens.tolist(), context_lens_host=(batch.starts + batch.query_lens).tolist(),
            work_seq=static.work_seq, work_start=static.work_start, tail_rows=static.tail_rows)
        return self.sample_logits(self._forward(static, meta), tail, batch, static.positions)

    def load(self, arrays, tokens: int) -> StepTail:
        """Fill the static inputs of `tokens` with the step's arrays and patch the block tables; the tail's device
        views for sample_logits (the caller checked inputs.fits)."""
        tail = self.inputs.load(*arrays, tokens)
        self.state.apply(tail)
        self._device_drafts(self.inputs.views(tokens), tail, arrays[1]["draft_ids"])
        return tail

    def _device_drafts(self, v: TokenViews, tail: StepTail, draft_ids: np.ndarray) -> None:
        """Decode rows verifying device drafts beside prompts: a draft model proposes them into the step's inputs
        (runner/draft_model.py); n-gram device drafts run as decode rows only (engine/scheduler.py)."""
        if not (draft_ids == DEVICE_DRAFT).any():
            return
        if self.state.draft_model is None:
            raise ValueError("a token-count step verifies device drafts, which only a draft model proposes here")
        self.state.draft_model.propose_tokens(v, tail, self.state.block_tables, self.state.last_tokens)

    def captured(self, tokens: int) -> torch.Tensor:
        """The forward over the static inputs of `tokens` tokens, into the static hidden states (graph-capturable:
        every sequence may hold cached context, so attention is the paged kernel over a fixed work list)."""
        if self.static_hidden is None:
            self.static_hidden = torch.empty(self.inputs.max_tokens, self.model.hidden_size, dtype=self.model.dtype,
                                             device=self.state.block_tables.device)
        v = self.inputs.views(tokens)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=v.slot_mapping, context_lens=v.context_lens,
            block_tables=self.state.block_tables, table_rows=v.slots, cu_seqlens_q=v.cu_seqlens_q,
            max_seqlen_q=tokens, has_cached_prefix=True, work_seq=v.work_seq, work_start=v.work_start,
            tail_rows=v.tail_rows)
        out = self.static_hidden[:tokens]
        out.copy_(self._forward(v, meta))
        return out

    def prepare_padding(self, tokens: int) -> None:
        """Load an all-padding step of `tokens` tokens (warm-up and capture)."""
        empty = np.zeros(0, np.int32)
        self.load(self.arrays(PrefillBatch(empty, empty, empty, empty, empty, BlockUpdates(), empty, None, 1)), tokens)

    def _forward(self, v: TokenViews, meta: AttentionMetadata) -> torch.Tensor:
        ids = torch.where(v.ids >= 0, v.ids, self.state.last_tokens[v.token_slots.long()])
        hidden = self.model(ids, v.positions, meta)
        if self.state.draft_model is not None:  # the draft's cache holds every token the target's does
            self.state.draft_model.mirror(ids, v.positions, meta)
        return hidden

    def sample_logits(self, hidden: torch.Tensor, tail: StepTail, batch: PrefillBatch,
                      positions: torch.Tensor) -> "SampledLogits":
        """The logits of the sampled rows and what their sampling needs (positions: the step's, by token row)."""
        rows = tail.sample_token_rows.long()
        logits = self.model.compute_logits(hidden[rows])
        params = tail.sampling() if batch.sampling is not None else None
        prompt = None
        if len(batch.prompt_logprob_rows):
            packed = prompt_logprobs.compute(self.model, hidden, tail.logprob_rows, tail.logprob_targets,
                                             batch.prompt_logprob_k, self.logprob_chunk)
            prompt = prompt_logprobs.PromptLogprobsHandle(packed, len(batch.prompt_logprob_rows))
        verify = VerifyRows(tail.draft_ids, tail.group_back) if batch.sample_counts is not None else None
        sampled_positions = positions[rows] if self.state.drafting is not None else None  # (only histories read them)
        return SampledLogits(logits, params, tail.sampled_slots, prompt, verify, sampled_positions)


class SampledLogits(NamedTuple):
    """A prompt / mixed step's sampled rows: their logits, parameters and slots on the device, the prompt logprobs
    asked for (a PromptLogprobsHandle or None), the drafts they verify (None: no drafts) and their positions."""

    logits: torch.Tensor
    params: object | None  # SamplingTensors
    slots: torch.Tensor
    prompt_logprobs: object | None
    verify: VerifyRows | None
    positions: torch.Tensor | None  # the sampled rows' positions (drafting on the device only)


__all__ = ["DecodeForward", "TokenForward", "SampledLogits"]
