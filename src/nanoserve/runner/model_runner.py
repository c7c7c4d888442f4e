"""ModelRunner: runs one step's batch on the device and samples it, without waiting for the result.

Start-up (runner/startup/) builds everything it runs on. A step reads top-down: the graph table (runner/dispatch.py)
routes it — decode batches to the smallest captured bucket that fits, prompt / mixed batches to the smallest
token-count graph of at least their tokens, anything else eagerly at its own size — then the sampler writes the
sampled ids into the slots' last-token cells on the device and starts their copy to the host; the returned
SampleHandle is read by the engine one step later. A step whose sampler must wait (structured outputs: the grammar
masks are filled meanwhile) returns a PendingSample instead, which sample_deferred() completes; the runner itself
keeps no state between the two calls.

Under tensor parallelism (tp: this rank's place in the group) every rank builds its own runner over its shards and
makes the same calls in the same order (runner/parallel/group.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.model.communicator import TensorParallel
from nanoserve.runner.batch import DecodeBatch, PrefillBatch, SamplingBatch
from nanoserve.runner.dispatch import Kind
from nanoserve.runner.info import RunnerCounters, RunnerInfo
from nanoserve.runner.kv_cache import KVCacheSpec
from nanoserve.runner.sampler import SampleHandle, SamplingPath, SamplingTensors
from nanoserve.runner.speculative import VerifyRows
from nanoserve.runner.startup import start
from nanoserve.runner.startup.bucket_plan import BatchDistribution


@dataclass
class PendingSample:
    """A step launched without its sampler (execute(defer_sampling=True)): what sample_deferred() samples."""

    logits: torch.Tensor
    params: SamplingTensors | None
    slots: torch.Tensor
    prompt_logprobs: object | None  # a PromptLogprobsHandle
    bucket: int | None  # the decode graph that made the logits (its sampler graph may follow)
    verify: VerifyRows | None  # the rows verify drafts (runner/speculative.py)
    positions: torch.Tensor | None  # the sampled rows' positions (drafting on the device records their samples)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, tp: TensorParallel | None = None):
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.tp = tp or TensorParallel(device=self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.rng = torch.Generator(device=self.device).manual_seed(config.seed)  # probes and unseeded sampling
        s = start(config, hf_config, self.tp, self.rng)
        self.model, self.kv, self.buffers, self.graphs = s.model, s.kv, s.buffers, s.graphs
        self.info = RunnerInfo(self.model.vocab_size, str(self.device), s.num_kv_blocks, s.block_bytes,
                               str(s.kv.dtype).removeprefix("torch."), s.kv.scales,
                               tuple(s.graphs.sizes(Kind.DECODE)), tuple(s.graphs.sizes(Kind.TOKENS)),
                               s.step_curve, s.token_curve, s.draft_curve, s.verify_curve)
        self.counters = RunnerCounters()
        self.batch_histogram = BatchDistribution.empty(config.max_num_seqs)

    def close(self) -> None:
        """Drop the graphs and the KV cache; their memory is freed with the last reference."""
        draft = self.buffers.state.draft_model if self.buffers is not None else None
        self.graphs = self.buffers = None
        KVCacheSpec.release(self.model)
        if draft is not None:
            KVCacheSpec.release(draft.model)

    def save_batch_histogram(self) -> None:
        """Write the decode batch sizes seen (cudagraph_plan), for the next start-up's plan."""
        if self.config.cudagraph_plan is not None and self.batch_histogram.counts.sum() > 0:
            self.batch_histogram.save(self.config.cudagraph_plan)

    # -- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: DecodeBatch | PrefillBatch,
                defer_sampling: bool = False) -> SampleHandle | PendingSample | None:
        """Launch the step and its sampling; None when the batch samples nothing (a mid-prompt chunk).
        defer_sampling: launch the forward only; the PendingSample returned is sampled by sample_deferred() (the
        engine fills the grammar bitmask in between), before any other step runs on this runner."""
        verify = None
        if isinstance(batch, PrefillBatch):
            (logits, params, slots, prompt, verify, positions), bucket = self._prefill(batch), None
        else:
            logits, rows, bucket = self._decode(batch)
            views, b, prompt = self.buffers.decode_inputs.views(rows), batch.size, None
            params, slots, positions = views.sampling(b), views.slots[:b], views.positions[:b]
            if batch.draft_ids is not None:
                draft = self.buffers.state.draft_model
                verify = VerifyRows(views.draft_ids[:b], views.group_back[:b], *(
                    (draft.q[:b], views.draft_sampled[:b]) if draft is not None else ()))
        if batch.sampling is None or not len(batch.sampling):
            return None if prompt is None else SampleHandle.empty(prompt)
        pending = PendingSample(logits, params, slots, prompt, bucket, verify, positions)
        return pending if defer_sampling else self.sample_deferred(pending, batch.sampling)

    @torch.inference_mode()
    def sample_deferred(self, pending: PendingSample, sampling: SamplingBatch) -> SampleHandle:
        """Launch the sampler of a launched step with its (now complete) SamplingBatch. A plain batch after a decode
        graph replays that bucket's sampler graph when the table routes one."""
        sampler, replay = self.buffers.sampler, None
        kind = self._sample_kind(pending, sampling)
        size = self.graphs.route(kind, pending.bucket) if kind is not None else None
        if size is not None:
            replay = functools.partial(self.graphs.replay, kind, size)
        drafting, record = self.buffers.state.drafting, None
        if drafting is not None:  # the samples join their slots' device histories (a verification's graph: itself)
            record = functools.partial(drafting.record_samples, slots=pending.slots, positions=pending.positions,
                                       last_tokens=self.buffers.state.last_tokens)
        handle = sampler(pending.logits, sampling, pending.params, self.buffers.state.last_tokens, pending.slots,
                         replay, pending.verify, record)
        handle.prompt_logprobs = pending.prompt_logprobs
        return handle

    def _sample_kind(self, pending: PendingSample, sampling: SamplingBatch) -> Kind | None:
        """The sampler graph kind of a step after a decode graph: the plain sample (masked or not) or a verification's
        (unmasked, one-hot drafts); None: eager (a token-count step, or the general sampler's work)."""
        if pending.bucket is None or self.buffers.sampler.path(sampling) is not SamplingPath.FUSED:
            return None
        masked = sampling.grammar_rows is not None
        if pending.verify is None:
            return Kind.SAMPLE_MASKED if masked else Kind.SAMPLE
        return Kind.SAMPLE_VERIFY if not masked and pending.verify.q is None else None

    def _prefill(self, batch: PrefillBatch):
        """A prompt / mixed step: the smallest token-count graph of at least its tokens, or eagerly."""
        fwd = self.buffers.token_forward
        arrays = fwd.arrays(batch)
        fits = fwd.inputs is not None and fwd.inputs.fits(batch, arrays[1])
        tokens = self.graphs.route(Kind.TOKENS, batch.num_tokens, fits)
        if tokens is None:
            self.counters.prefill_steps_eager += 1
            return fwd(batch, arrays)
        self.counters.prefill_steps_graph += 1
        self.counters.padding_tokens += tokens - batch.num_tokens
        tail = fwd.load(arrays, tokens)
        hidden = self.graphs.replay(Kind.TOKENS, tokens)
        return fwd.sample_logits(hidden, tail, batch, fwd.inputs.views(tokens).positions)

    def _decode(self, batch: DecodeBatch) -> tuple[torch.Tensor, int, int | None]:
        """Logits [b, vocab] of a decode batch, the rows the step ran (its bucket, or b when eager) and the bucket
        whose graph it replayed (None when eager)."""
        b, fwd = batch.size, self.buffers.decode_forward
        self.batch_histogram.record(b)
        propose = (self.buffers.state.draft_model is not None and batch.draft_slots is not None
                   and bool((batch.draft_slots >= 0).any()))  # a draft model proposes some row's drafts
        verify = batch.group_back is not None  # a sequence's rows read as one attention group
        kind = Kind.DRAFT if propose else Kind.VERIFY if verify else Kind.DECODE
        rows = self.graphs.route(kind, b)
        if rows is not None:
            self.counters.decode_steps_graph += 1
            self.counters.padding_rows += rows - b
            fwd.load(batch, rows)
            return self.graphs.replay(kind, rows)[:b], rows, rows
        self.counters.decode_steps_eager += 1
        if b > fwd.inputs.max_rows:
            raise ValueError(f"decode batch of {b} exceeds max_num_seqs={self.config.max_num_seqs}")
        fwd.load(batch, b)
        width = self.kv.blocks_for(int(batch.context_lens.max())) if b else 1  # read only the blocks in use
        return fwd(b, width, propose, verify), b, None


__all__ = ["ModelRunner", "PendingSample"]
