"""Sequence: the engine core's state for one sequence being generated.

With asynchronous scheduling the host runs one step ahead of the device, so a sequence may have
`num_pending` sampled tokens whose values are still on the device: they count towards its length (its
KV slots and positions are known) but not yet towards output_token_ids. A step that verifies d drafts counts d + 1
pending tokens, as if every draft is kept; reading it corrects the count (the device already knows the outcome: its
decode rows take their positions from it), so lengths and blocks are upper bounds meanwhile.
"""
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
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = field(default_factory=lambda: next(_counter))
    output_token_ids: list[int] = field(default_factory=list)  # tokens whose values the host knows
    num_pending: int = 0  # sampled tokens still on the device (async scheduling; verified drafts count as kept)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None  # the persistent batch row while running (device block table, last token)
    decoding: bool = False  # its prompt is done and its last token was sampled into its slot on the device
    block_table: list[int] = field(default_factory=list)
    num_synced_blocks: int = 0  # leading block_table entries already in the device's block table
    num_hashed_blocks: int = 0  # leading full blocks registered for prefix reuse
    block_hash: int | None = None  # the prefix hash chain through those blocks (kept here: a windowed one is freed)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache once the scheduled steps have run
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at the last allocation
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    grammar: object | None = None  # params.structured_outputs: its xgrammar GrammarMatcher (engine/grammar.py)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    prompt_logprobs: list = field(default_factory=list)  # params.prompt_logprobs: (logprob, top) per prompt token 1..
    num_prompt_logprobs_scheduled: int = 0  # prompt positions whose logprobs a launched step computes
    # speculative decoding: the drafts offered for the next step (the scheduler may run fewer), and the drafts this
    # sequence has had verified and accepted so far (its running acceptance rate)
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the ones still on the device included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next steps must run: 1 while decoding, more while (chunked) prefilling."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Known token ids [start, end) without building prompt + output (hot: per step for full blocks)."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    def draft_room(self, max_model_len: int) -> int:
        """Most drafts the next step may verify: every accepted draft and the token after them must fit max_tokens
        and max_model_len (rejected drafts' slots are rolled back, so only the outcome counts)."""
        room = max_model_len - self.num_tokens - 1
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - self.num_output_tokens - 1)
        return max(room, 0)

    def reached_length_limit(self, max_model_len: int, pending: bool = True) -> bool:
        """max_tokens or max_model_len is reached. pending=True (the scheduler): the device's tokens count, no
        further token may be scheduled; pending=False (a token's result): the known tokens end the sequence."""
        num_out = len(self.output_token_ids) + (self.num_pending if pending else 0)
        max_tokens = self.params.max_tokens
        return ((max_tokens is not None and num_out >= max_tokens)
                or len(self.prompt_token_ids) + num_out >= max_model_len)
