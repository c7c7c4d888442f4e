"""The batched sampler on the device, and the one device→host transfer of each step.

Sampling never leaves the device: per-row parameters arrive as device tensors (copied with the step's
other inputs), the sampled ids are written into each slot's last-token cell (the next step's input),
and everything the host needs (ids, logprobs) is packed into one int32 tensor and copied into pinned
memory without blocking. The host reads it one step later (`SampleHandle.result()`).

On CUDA the common case (each row greedy or sampled at a temperature, under a grammar's bitmask or not) is one
kernel (kernels/sampling.sample_tokens): the loop is host-bound at small models, and the ~15 torch ops of the general
path cost more host time than the device spends on them. After a decode graph's replay that kernel is itself
replayed from a CUDA graph of the same bucket (masked and not: runner/startup/graphs.py), over the static logits, the bucket's
temperatures and slots and a static bitmask. Its noise key is a device counter, read by the kernel and advanced after
it, starting from a seed drawn like the runner's generator's, so every tensor-parallel rank draws the same. The
general path (top-k, top-p, min-p, logprobs, min_tokens bans, logit_bias, penalties, seeded rows) runs torch ops on a
float32 copy; off CUDA every batch takes it.

Seeded rows draw their noise from their own generator, so a seeded request gives the same tokens
whatever else is batched, and in the same order whether or not the host runs ahead.
"""
from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import MAX_LOGPROBS
from nanoserve.kernels._triton import use_triton
from nanoserve.kernels.sampling import SampleScratch, masked_float_logits, sample_tokens
from nanoserve.kernels.verify import store_samples
from nanoserve.runner.batch import Penalties, SampledTokens, SamplingBatch
from nanoserve.runner.speculative import VerifyRows


@dataclass
class SamplingTensors:
    """Per-row parameters on the device (views of the step's input buffer)."""

    temperature: torch.Tensor  # [n] float32
    top_p: torch.Tensor
    top_k: torch.Tensor  # [n] int32
    min_p: torch.Tensor


class SampleHandle:
    """One step's sampled rows (and prompt logprobs, when asked), on their way to pinned host memory."""

    prompt_logprobs = None  # a PromptLogprobsHandle (runner/prompt_logprobs.py) when the step computed them

    def __init__(self, packed: torch.Tensor, event: torch.cuda.Event | None, num_rows: int, top_k: int | None,
                 row_k: list[int | None] | None, drafts_at: int | None = None):
        """drafts_at: where in the packed words the rows' draft ids start (a verification), else None."""
        self._packed, self._event = packed, event
        self.num_rows, self._top_k, self._row_k, self._drafts_at = num_rows, top_k, row_k, drafts_at

    @classmethod
    def empty(cls, prompt_logprobs) -> "SampleHandle":
        """No sampled row, only prompt logprobs (a mid-prompt chunk of a request that asked for them)."""
        handle = cls(torch.zeros(0, dtype=torch.int32), None, 0, None, None)
        handle.prompt_logprobs = prompt_logprobs
        return handle

    def ready(self) -> bool:
        """Whether result() would return at once."""
        return self._event is None or self._event.query()

    def result(self) -> SampledTokens:
        """Blocks until the device has produced this step's tokens."""
        out = self._result()
        if self.prompt_logprobs is not None:
            out.prompt_logprobs = self.prompt_logprobs.result()
        return out

    def _result(self) -> SampledTokens:
        if self._event is not None:
            self._event.synchronize()
        words = self._packed.numpy()
        n = self.num_rows
        out = SampledTokens(words[:n].tolist())
        if self._drafts_at is not None:
            out.draft_ids = words[self._drafts_at:self._drafts_at + n].tolist()
        if self._top_k is None:
            return out
        floats = words.view(np.float32)
        k = self._top_k
        out.logprobs = floats[n:2 * n].tolist()
        top_ids = words[2 * n:2 * n + n * k].reshape(n, k).tolist()
        top_vals = floats[2 * n + n * k:2 * n + 2 * n * k].reshape(n, k).tolist()
        out.top_logprobs = [list(zip(ids[:rk or 0], vals[:rk or 0])) for ids, vals, rk in
                            zip(top_ids, top_vals, self._row_k)]
        return out


class SamplingPath(enum.Enum):
    FUSED = "fused"  # the one kernel (or its graph, after a decode graph): each row greedy or at a temperature
    ARGMAX = "argmax"  # every row greedy, no logprobs, bans, biases, penalties or grammar, without the kernel
    GENERAL = "general"  # torch ops on a float32 copy: top-k/p, min-p, logprobs, bans, biases, penalties, seeds


class Sampler:
    """logits [n, V] + a SamplingBatch → sampled ids in the slots' last-token cells, and a SampleHandle."""

    def __init__(self, max_rows: int, device: torch.device, generator: torch.Generator | None = None,
                 vocab_size: int = 0):
        """generator: the noise of unseeded rows (None: torch's default RNG). Plain batches take the one kernel
        where the kernels run Triton (kernels/_triton.use_triton). A grammar's bitmask may cover every row (a
        verification's rows each have the mask of their position)."""
        self.device, self.generator = device, generator
        self.on_cuda = device.type == "cuda"
        words = max_rows * (3 + 2 * MAX_LOGPROBS)  # ids, logprobs, top pairs, draft ids
        # two pinned buffers: the host reads step N's while step N+1's copy is queued
        self._host = [torch.zeros(words, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.on_cuda else None for _ in range(2)]
        self._turn = 0
        self._fused = SampleScratch(max_rows, device) if use_triton(device) else None
        self._bitmask = torch.full((max_rows, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device) \
            if self._fused is not None else None  # the plain sample's mask: static, so its graphs read it
        # the plain sample's noise key, on the device: read by the kernel and advanced after it, so a graph of the
        # call draws anew each replay; seeded like the runner's generator (the same on every tensor-parallel rank)
        seed = random.Random(generator.initial_seed() if generator is not None else None).getrandbits(31)
        self._seed = torch.tensor([seed], dtype=torch.int64, device=device)
        # a verification's rows all sample into the dummy slot first (store_samples then stores the accepted runs),
        # and its graph packs the samples and drafts here for the one copy to the host
        self._dummy_slots = torch.empty(max_rows, dtype=torch.int32, device=device)
        self._packed = torch.zeros(2 * max_rows, dtype=torch.int32, device=device)

    @property
    def fuses(self) -> bool:
        return self._fused is not None

    def path(self, batch: SamplingBatch) -> SamplingPath:
        """The one decision of how a batch is sampled."""
        if self._fused is not None and batch.is_plain:
            return SamplingPath.FUSED
        if (batch.all_greedy and batch.num_logprobs is None and batch.penalties is None and not len(batch.banned_rows)
                and not len(batch.bias_rows) and batch.grammar_rows is None):  # top-k/p, min-p, seeds: moot
            return SamplingPath.ARGMAX
        return SamplingPath.GENERAL

    def plain_forward(self, logits: torch.Tensor, inputs, last_tokens: torch.Tensor, masked: bool):
        """rows → the plain sample of a decode bucket, as its graph records it: over the static logits' prefix, the
        bucket's temperatures and slots (inputs(rows) → (temperature, slots)), the static bitmask (masked) and the
        device seed. Padded rows are greedy and store into the dummy slot."""
        def plain(rows: int) -> torch.Tensor:
            temperature, slots = inputs(rows)
            return self._plain(logits[:rows], rows if masked else 0, temperature, slots, last_tokens)
        return plain

    def verify_forward(self, logits: torch.Tensor, views, last_tokens: torch.Tensor, drafting=None):
        """rows → the sample of a decode bucket that verifies drafts, as its graph records it (Kind.SAMPLE_VERIFY):
        the plain kernel over the static logits' prefix and the bucket's temperatures into the dummy slot, then the
        accepted runs stored (kernels/verify.py; drafting, a DraftState: into the device histories too; padded rows,
        in the dummy slot, store nothing), and the packed words the host reads: the rows' samples, then their drafts
        (views(rows): the bucket's DecodeViews, whose draft ids the decode graph resolved)."""
        dummy = len(last_tokens) - 1
        self._dummy_slots.fill_(dummy)

        def verify(rows: int) -> torch.Tensor:
            v = views(rows)
            tokens = self._plain(logits[:rows], 0, v.temperature, self._dummy_slots[:rows], last_tokens)
            history = () if drafting is None else (v.positions, drafting.history, drafting.hist_len)
            store_samples(tokens, v.slots, last_tokens, v.draft_ids, v.group_back, *history, pad_slot=dummy)
            packed = self._packed[:2 * rows]
            packed[:rows].copy_(tokens)
            packed[rows:].copy_(v.draft_ids)
            return packed
        return verify

    def _plain(self, logits: torch.Tensor, masked_rows: int, temperature: torch.Tensor, slots: torch.Tensor,
               last_tokens: torch.Tensor) -> torch.Tensor:
        """The one kernel (masked by the static bitmask's first masked_rows rows when > 0), then the next key."""
        bitmask = self._bitmask[:masked_rows] if masked_rows else None
        tokens = sample_tokens(logits, bitmask, temperature, self._seed, slots, last_tokens, self._fused)
        self._seed.add_(1)
        return tokens

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, params: SamplingTensors,
                 last_tokens: torch.Tensor, slots: torch.Tensor, replay=None,
                 verify: VerifyRows | None = None, record=None) -> SampleHandle:
        """Sample one token per row; store it at last_tokens[slots]; start the copy to the host. replay: the graph
        of this plain sample (runner/dispatch.py routed it), when there is one. verify: the rows verify drafts
        (runner/speculative.py); only each sequence's last accepted row is stored, and the rows' drafts travel back
        with the samples. record: called with the sampled ids on the device and `verify` (drafting on the device:
        it stores the verified rows' tokens itself, with their histories)."""
        n = len(batch)
        if logits.shape[0] != n:
            raise ValueError(f"got {logits.shape[0]} logit rows for {n} sampled rows")
        if verify is not None and replay is not None:  # the verification's graph: sample, store (and record), pack
            packed = replay()
            return self._copy_to_host(packed, n, None, None, packed.numel() // 2)
        if verify is None:
            tokens, handle = self._sample_store(logits, batch, params, last_tokens, slots, replay)
        else:
            dummy = len(last_tokens) - 1  # every row stores there first; the accepted run's last row then to its slot
            tokens, handle = self._sample_store(logits, batch, params, last_tokens, torch.full_like(slots, dummy), None,
                                                verify)
            if record is None:
                store_samples(tokens, slots, last_tokens, verify.draft_ids, verify.group_back)
        if record is not None:
            record(tokens, verify)
        return handle

    def _sample_store(self, logits: torch.Tensor, batch: SamplingBatch, params: SamplingTensors,
                      last_tokens: torch.Tensor, slots: torch.Tensor, replay,
                      verify: VerifyRows | None = None) -> tuple[torch.Tensor, SampleHandle]:
        """The sampled ids [n] int32, stored at last_tokens[slots], and their handle (verify: the rows' draft ids are
        copied to the host with them)."""
        n = len(batch)
        drafts = verify.draft_ids if verify is not None else None
        path = self.path(batch)
        if path is SamplingPath.FUSED:
            masked = batch.grammar_rows is not None
            if masked:  # (from pinned memory: no sync)
                self._bitmask[:n].copy_(batch.grammar_bitmask, non_blocking=True)
            tokens = replay()[:n] if replay is not None else \
                self._plain(logits, n if masked else 0, params.temperature, slots, last_tokens)
            return tokens, self._to_host(tokens, None, None, None, drafts)
        top_k = batch.max_logprobs
        raw_logprobs = None
        if path is SamplingPath.ARGMAX:
            tokens = logits.argmax(dim=-1)
        else:
            if batch.grammar_rows is not None:  # before the logprobs, as vLLM: they cover the allowed tokens
                logits = self._masked(logits, batch)
            else:  # a float32 copy: changed in place below
                logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            if top_k is not None:
                raw_logprobs = torch.log_softmax(logits, dim=-1)
            tokens = self._sample(logits, batch, params, verify)
        tokens = tokens.to(torch.int32)
        last_tokens.index_copy_(0, slots.long(), tokens)
        return tokens, self._to_host(tokens, raw_logprobs, top_k, batch.num_logprobs, drafts)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, params: SamplingTensors,
                verify: VerifyRows | None = None) -> torch.Tensor:
        if len(batch.bias_rows):  # before the bans: a banned token stays banned whatever its bias
            self._add_logit_bias(logits, batch)
        if len(batch.banned_rows):
            in_vocab = batch.banned_tokens < logits.shape[1]
            rows = torch.from_numpy(batch.banned_rows[in_vocab]).to(self.device, torch.long)
            cols = torch.from_numpy(batch.banned_tokens[in_vocab]).to(self.device, torch.long)
            logits[rows, cols] = -math.inf
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
        greedy_rows = batch.temperature <= 0
        tokens = logits.argmax(dim=-1) if greedy_rows.any() else None
        if not greedy_rows.all():
            probs = target_probs(logits, batch, params)
            sampled = race(probs, batch, self.generator)
            if batch.draft_sampled is not None and verify is not None and verify.q is not None:
                sampled = against_draft(probs, sampled, verify, self.generator)
            tokens = sampled if tokens is None else torch.where(params.temperature <= 0, tokens, sampled)
        return tokens

    def _masked(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Structured outputs: the float32 logits with the grammar rows' disallowed tokens (padding columns beyond the
        tokenizer's vocabulary included) at -inf, in one kernel (kernels/sampling.py). The other rows' masks allow
        everything: the kernel runs over all rows, with no row indices to copy (the bitmask comes from pinned
        memory, without a sync)."""
        return masked_float_logits(logits, batch.grammar_bitmask.to(self.device, non_blocking=True))

    def _add_logit_bias(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        """logit_bias: logits[row, token] += bias, on the device (ids beyond the logits' width are dropped)."""
        keep = batch.bias_tokens < logits.shape[1]
        rows, cols, vals = (torch.from_numpy(a[keep]).to(self.device) for a in
                            (batch.bias_rows, batch.bias_tokens, batch.bias_values))
        logits.index_put_((rows.long(), cols.long()), vals.to(logits.dtype), accumulate=True)

    def _to_host(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, top_k: int | None,
                 row_k: list[int | None] | None, drafts: torch.Tensor | None = None) -> SampleHandle:
        parts = [tokens]
        if top_k is not None:
            parts.append(raw_logprobs.gather(1, tokens.long()[:, None])[:, 0].contiguous().view(torch.int32))
            if top_k:
                vals, ids = raw_logprobs.topk(min(top_k, raw_logprobs.shape[1]), dim=-1)
                k = ids.shape[1]
                parts += [ids.to(torch.int32).flatten(), vals.contiguous().view(torch.int32).flatten()]
                top_k = k
        if drafts is not None:
            parts.append(drafts.to(torch.int32))
        packed = torch.cat(parts) if len(parts) > 1 else tokens
        n = tokens.numel()
        return self._copy_to_host(packed, n, top_k, row_k, packed.numel() - n if drafts is not None else None)

    def _copy_to_host(self, packed: torch.Tensor, n: int, top_k: int | None, row_k: list[int | None] | None,
                      drafts_at: int | None) -> SampleHandle:
        """One copy of the packed words into the next pinned buffer, without blocking; their handle."""
        host = self._host[self._turn][:packed.numel()]
        event = self._events[self._turn]
        self._turn ^= 1
        if event is not None:
            host.copy_(packed, non_blocking=True)
            event.record()
        else:
            host.copy_(packed)
        return SampleHandle(host, event, n, top_k, row_k, drafts_at)


def sample_rows(logits: torch.Tensor, batch: SamplingBatch, params: SamplingTensors,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race (argmax of probs / E, E ~ Exp(1)); unseeded
    rows draw E from `generator`, seeded rows from their own."""
    return race(target_probs(logits, batch, params), batch, generator)


def race(probs: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """A draw per row from (unnormalized) probs: the argmax of probs / E, E ~ Exp(1) (seeded rows: their own)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, g in enumerate(batch.generators or ()):
        if g is not None and batch.temperature[i] > 0:
            noise[i].exponential_(generator=g)
    return (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)


def against_draft(probs: torch.Tensor, sampled: torch.Tensor, verify: VerifyRows,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Rejection sampling of the drafts a draft model sampled from q (verify.sampled[r]: row r checks one; unseeded
    rows only): keep draft d with probability min(1, p(d) / q(d)), else draw from max(p − q, 0). The output is then
    distributed as p, and a rejected row's draw is never d (there p(d) < q(d)), so "kept while the sample equals the
    draft" (kernels/verify.py) holds as for one-hot drafts. Other rows keep `sampled`."""
    n = probs.shape[0]
    p = probs / probs.sum(dim=-1, keepdim=True)
    q = verify.q[:n]
    d = verify.draft_ids[:n].long().clamp(min=0)[:, None]
    accept = torch.rand(n, device=p.device, generator=generator) * q.gather(1, d)[:, 0] <= p.gather(1, d)[:, 0]
    residual = (p - q).clamp_min_(0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    drawn = torch.where(accept, d[:, 0], (residual / torch.empty_like(residual).exponential_(
        generator=generator).clamp_min_(1e-10)).argmax(dim=-1))
    return torch.where(verify.sampled[:n] > 0, drawn, sampled)


def target_probs(logits: torch.Tensor, batch: SamplingBatch, params: SamplingTensors) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p (rows at temperature 0: at 1)."""
    n, vocab = logits.shape
    temperature = torch.where(params.temperature > 0, params.temperature, 1.0)
    logits = logits / temperature[:, None]
    use_top_k = bool(((batch.top_k > 0) & (batch.top_k < vocab)).any())
    use_top_p = bool((batch.top_p < 1).any())
    if use_top_k or use_top_p:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        if use_top_k:  # keep logits >= the k-th largest (ties at the boundary are kept)
            k = torch.where((params.top_k > 0) & (params.top_k < vocab), params.top_k, vocab).long()
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, -math.inf)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
        if use_top_p:  # keep the smallest prefix whose mass reaches top_p (at least one token)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            keep = (mass_before < params.top_p[:, None]).sum(dim=-1).clamp(min=1)
            keep = torch.where(params.top_p < 1, keep, vocab)
            threshold = sorted_logits.gather(1, (keep - 1)[:, None])
            logits = logits.masked_fill(logits < threshold, -math.inf)
    if (batch.min_p > 0).any():  # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
        log_min_p = torch.where(params.min_p > 0, params.min_p.clamp_min(1e-30).log(), -math.inf)
        floor = logits.max(dim=-1, keepdim=True).values + log_min_p[:, None]
        logits = logits.masked_fill(logits < floor, -math.inf)
    return logits.softmax(dim=-1)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts; lists are padded with `vocab`, a column that is dropped."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        ids = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """Repetition penalty over prompt+output tokens, presence/frequency penalties over output tokens (in place)."""
    vocab, device = logits.shape[1], logits.device
    rep, freq, pres = (torch.from_numpy(a).to(device)[:, None] for a in (p.repetition, p.frequency, p.presence))
    out_counts = _token_counts(p.output_token_ids, vocab, device)
    seen = (_token_counts(p.prompt_token_ids, vocab, device) > 0) | (out_counts > 0)
    x = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits.copy_(x - freq * out_counts - pres * (out_counts > 0).float())
