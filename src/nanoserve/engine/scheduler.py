"""Scheduler: which sequences run in the next step, and how many tokens each, under a token budget.

Every step has a budget of max_num_batched_tokens. Running sequences come first, in arrival order: a
decoding sequence costs one token, a sequence part-way through its prompt gets the next chunk that fits.
Waiting sequences are then admitted first-come first-served into what is left, each starting with a
chunk of its prompt (after any prefix-cache hit). A step whose every row is one decode token replays a
batch-size CUDA graph; a step with prefill chunks replays a token-count graph (or runs eagerly above the largest),
and the decode rows ride along in it.

With prompt_token_caps (the engine sets them from the measured step-time curves when chunk_time_ratio is on), a
step that decodes d rows carries at most caps[d] prompt tokens, so the decoding streams are not held up by a
long chunk; a step with nothing to decode still takes the whole budget.

With a sliding window on every layer, a running sequence holds only the blocks its next queries read
(BlockManager.free_slid_out), so admission and preemption count just those.

When a running sequence needs a KV block and none is free, the latest-arrived running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later
(prompt + the tokens it already produced), so no request is lost.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.runner.speculative import DEVICE_DRAFT
from nanoserve.runner.startup.bucket_plan import StepTime

logger = logging.getLogger("nanoserve")


@dataclass
class ScheduledStep:
    """The sequences of one step, in row order, and how many of their tokens run."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # tokens already in the cache before this step
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # the chunk reaches the sequence's end: sample a token
    decode_rows: list[bool] = field(default_factory=list)  # its first token's id is on the device (the last sampled)
    drafts: list[list[int]] = field(default_factory=list)  # a decode row's draft tokens to verify after that one
    is_decode: bool = True  # every row is one decode token: the step can replay a batch-size CUDA graph

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def add(self, seq: Sequence, num_tokens: int, decoding: bool, drafts: list[int] = ()) -> None:
        """num_tokens: the row's tokens, its drafts included."""
        self.seqs.append(seq)
        self.starts.append(seq.num_computed_tokens)
        self.num_new_tokens.append(num_tokens)
        self.samples.append(seq.num_computed_tokens + num_tokens - len(drafts) == seq.num_tokens)
        self.decode_rows.append(decoding)
        self.drafts.append(list(drafts))
        self.is_decode = self.is_decode and decoding and not drafts

    @property
    def has_drafts(self) -> bool:
        return not self.is_decode and any(self.drafts)

    @property
    def sampled_drafts(self) -> list[list[int]]:
        """Each sampling sequence's drafts, in the order of its sampled rows (a row, and one more per draft)."""
        return [d for d, samples in zip(self.drafts, self.samples) if samples]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, prompt_token_caps: list[int] | None = None):
        """prompt_token_caps: decode rows → prompt tokens a step may add beside them (chunk_caps), or None."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))  # popped from the end: low slots first
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.prompt_token_caps = prompt_token_caps
        spec = config.speculative  # device drafts beside prompts: only a draft model proposes them there
        self.drafts_beside_prompts = spec is not None and spec.drafts_in_token_steps
        self.tail_blocks = config.kv_cache_dtype == "fp8"  # its cache keeps a tail (chunk_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(step, budget)
        self._schedule_waiting(step, budget)
        return step

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        """Decode rows first (one token each, preempting for blocks), then the next chunks of prompts in progress. The
        blocks that slid out of every layer's window go back to the pool first (a no-op without a window)."""
        if self.block_manager.window is not None:  # no per-sequence call on every step of an unwindowed model
            for seq in self.running:
                self.block_manager.free_slid_out(seq)
        budget = self._schedule_decodes(step, budget)
        caps = self.prompt_token_caps
        if caps and step.seqs:
            budget = min(budget, caps[min(len(step.seqs), len(caps) - 1)])
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.decoding:
                n = self.chunk_tokens(seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget),
                                      seq.num_uncomputed_tokens)
                if self.block_manager.allocate(seq, seq.num_computed_tokens + n):  # else it waits for blocks
                    self._add_to_step(step, seq, n, decoding=False)
                    budget -= n
        return budget

    def chunk_tokens(self, start: int, n: int, remaining: int) -> int:
        """A prompt chunk's tokens from `start` (n of the remaining ones): n, except over an fp8 cache (its tail:
        kernels/kv_quant.py), where a chunk that starts inside a block stops at that block's end, so a chunk that
        reads earlier tokens of its first block from the tail spans one block, and a longer one starts on a block
        boundary (its tail writes, to the last two blocks' banks, cannot overwrite what it reads); a chunk of a block
        or more that does not end the prompt ends on a boundary, so the next starts on one. Prefix hits start on a
        boundary already."""
        bs = self.block_manager.block_size
        if not self.tail_blocks:
            return n
        if start % bs:
            return min(n, bs - start % bs)
        return n // bs * bs if bs <= n < remaining else n

    def _schedule_decodes(self, step: ScheduledStep, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if not seq.decoding or seq.reached_length_limit(self.max_model_len):
                continue  # a prompt in progress, or a sequence ended by its pending token
            drafts, seq.draft_token_ids = seq.draft_token_ids[:min(seq.draft_room(self.max_model_len), budget - 1)], []
            if drafts and not self.block_manager.allocate(seq, seq.num_tokens + len(drafts)):
                drafts = []  # no blocks for them: the row decodes its one token
            while not self.block_manager.can_append_one(seq):
                victim = self.running[-1]  # latest arrival, not scheduled in this step yet
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, seq.num_tokens)
                self._add_to_step(step, seq, 1 + len(drafts), decoding=True, drafts=drafts)
                budget -= 1 + len(drafts)
        return budget

    def _schedule_waiting(self, step: ScheduledStep, budget: int) -> None:
        bm = self.block_manager
        if not self.drafts_beside_prompts and any(DEVICE_DRAFT in d for d in step.drafts):
            return  # n-gram device drafts run as decode rows only (engine/speculation.py)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # just preempted: its last step's token is still on the device
                break
            hits = [] if seq.params.prompt_logprobs is not None else bm.cached_prefix(seq)  # logprobs need every row
            n = min(seq.num_tokens - len(hits) * bm.block_size, budget)
            if not bm.allocate(seq, len(hits) * bm.block_size + n, hits):
                break
            self.waiting.popleft()
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            self._add_to_step(step, seq, n, decoding=False)
            budget -= n

    def _add_to_step(self, step: ScheduledStep, seq: Sequence, n: int, decoding: bool, drafts: list[int] = ()) -> None:
        step.add(seq, n, decoding, drafts)
        if not decoding:  # the chunk's tokens are known: its full blocks can serve other prompts
            self.block_manager.register_full_blocks(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        if step.samples[-1]:
            seq.num_pending += 1 + len(drafts)  # (as if every draft is kept: the read corrects it)
            seq.decoding = True

    # -- state changes ----------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its blocks and slot (it may be running or waiting)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        seq.decoding = False


def prompt_token_caps(config: EngineConfig, runner) -> list[int] | None:
    """chunk_time_ratio's caps from the runner's measured curves (RunnerInfo's batch-size and token-count: planned
    "auto" graphs); None when off or not measured (then only max_num_batched_tokens bounds a step)."""
    ratio = config.chunk_time_ratio
    if not ratio or runner.step_curve is None or runner.token_curve is None:
        if ratio:
            logger.info("chunk_time_ratio %.1f is off: it needs measured step curves (planned CUDA graphs)", ratio)
        return None
    caps = chunk_caps(runner.token_curve, runner.step_curve, config.max_num_seqs, config.max_num_batched_tokens, ratio)
    shown = ", ".join(f"{d} rows: {caps[d]}" for d in sorted({1, 16, 64, len(caps) - 1}) if d < len(caps))
    logger.info("prompt tokens beside decode rows (step time <= %.1f decode steps): %s", ratio, shown)
    return caps


def chunk_caps(token_curve: StepTime, decode_curve: StepTime, max_rows: int, max_tokens: int, ratio: float,
               floor: int = 16) -> list[int]:
    """caps[d]: the prompt tokens a step with d decode rows may carry so that its time (token_curve at d + chunk
    tokens) stays within ratio × the decode-only step of d rows (decode_curve(d)). caps[0] = max_tokens: with
    nothing decoding, nobody waits on the chunk. At least `floor`, so prompts always progress."""
    rows = np.arange(1, max_rows + 1)
    limit = ratio * np.asarray(decode_curve(rows), dtype=np.float64)
    step_ms = np.asarray(token_curve(np.arange(1, max_tokens + 1)), dtype=np.float64)  # non-decreasing
    largest_total = np.searchsorted(step_ms, limit, side="right")  # the most tokens whose step fits the limit
    caps = np.clip(largest_total - rows, floor, max_tokens)
    return [max_tokens] + [int(c) for c in caps]
