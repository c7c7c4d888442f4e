"""Sequence: one completion being generated: its tokens, status, cache blocks and sampling state."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from nanoserve.sampling import SamplingParams

_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = field(default_factory=lambda: next(_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at the last prefill
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per output token: {token_id: logprob}
    cumulative_logprob: float = 0.0
    # detokenizer state (engine/detokenizer.py)
    text: str = ""
    read_offset: int = 0
    prefix_offset: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (hot: called per step for full blocks)."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = len(self) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size
