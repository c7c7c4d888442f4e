"""Continuous batching: which sequences run this step, and whether it is a prefill or a decode step.

Waiting prompts are prefilled as soon as blocks and the token budget allow (a prefill step);
otherwise every running sequence decodes one token (a decode step). The batch therefore changes
every step. When the cache runs out during decode, the newest running sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later
(prompt + the tokens it already produced), so no request is lost.
"""
from __future__ import annotations

from collections import deque

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Returns (sequences, is_prefill). Empty when nothing can run."""
        prefill = self._schedule_prefill()
        if prefill:
            return prefill, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + len(seq) > self.max_num_batched_tokens and scheduled:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:  # seq alone cannot grow (max_model_len fits the cache, so this needs others' blocks)
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its blocks (it may be running or waiting)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
