"""Every message that crosses the engine core's boundary: requests in, per-step deltas and stats out, and the
envelopes and start-up handshake of the core in its own process (engine/core_process.py, engine/core_client.py).

msgspec Structs, so the same objects are passed in-process (offline LLM) and encoded as msgpack between
the API process and the engine-core process (a tagged union per direction: no wire format is written by
hand). The core deals in single sequences: a request with n > 1 is fanned out into n core requests by
the front end (engine/output.py), each with its own seed.
"""
from __future__ import annotations

import msgspec

from nanoserve.config import EngineConfig
from nanoserve.sampling import SamplingParams


class EngineRequest(msgspec.Struct, array_like=True):
    """One sequence to generate. params.n is 1 here; prompt_token_ids are already validated."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class SeqOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step added to one sequence: usually one token; the last delta carries the finish reason.

    token_logprobs[i] is the sampled token's logprob and top_logprobs[i] the (token id, logprob) pairs of the
    params.logprobs most likely tokens, for new_token_ids[i] (both None unless logprobs were asked for).
    """

    request_id: str
    new_token_ids: list[int]
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it (stop strings are the front end's)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (sent with the first token)
    error: str | None = None  # finish_reason "error": why the core refused or dropped the request
    # params.prompt_logprobs, with the first token: per prompt token after the first, (its logprob, top pairs)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class EngineStats(msgspec.Struct):
    """The core's live state and counters (read by /metrics and benchmarks)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_steps_graph: int = 0
    decode_steps_eager: int = 0
    mixed_steps: int = 0  # steps that prefilled a chunk (decode rows may ride along)
    prefill_steps_graph: int = 0  # of those, replayed from a token-count graph
    prefill_steps_eager: int = 0
    padding_rows: int = 0
    padding_tokens: int = 0  # padded tokens in graph-replayed prompt / mixed steps
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    kv_cache_dtype: str = ""  # the KV cache as the runner allocated it (RunnerInfo): element type, fp8 scale design
    kv_cache_scales: str | None = None
    kv_block_bytes: int = 0
    # the engine loop's time in the steps it launched: its own work, and waiting for sampled tokens (HostClock)
    host_busy_seconds: float = 0.0
    host_wait_seconds: float = 0.0
    # speculative decoding (speculative_config): its method, the sequences that verified drafts (a row per step),
    # the drafts proposed and accepted, and acceptances by draft position (index j: drafts accepted at position j)
    spec_method: str | None = None
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []

    def speculation_since(self, before: "EngineStats") -> dict | None:
        """Speculative decoding's counters since `before` (None when it is off): drafts, acceptance, mean accepted
        length (accepted drafts + 1 per verifying sequence step), acceptances by draft position (read by `nanoserve
        bench` and the server's stats log)."""
        if self.spec_method is None:
            return None
        drafts = self.spec_num_drafts - before.spec_num_drafts
        proposed = self.spec_draft_tokens - before.spec_draft_tokens
        accepted = self.spec_accepted_tokens - before.spec_accepted_tokens
        earlier = before.spec_accepted_per_position + [0] * len(self.spec_accepted_per_position)
        return {"method": self.spec_method, "num_drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
                "accepted_per_position": [a - b for a, b in zip(self.spec_accepted_per_position, earlier)]}


# -- envelopes: API process → core process ---------------------------------------------------------
class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[EngineRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = AddRequests | AbortRequests | Shutdown


# -- envelopes: core process → API process ---------------------------------------------------------
class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """What one loop iteration produced: the step's deltas (and refusals of new requests), then the stats."""

    outputs: list[SeqOutput]
    stats: EngineStats


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    reason: str


CoreOutput = StepOutputs | EngineDead


# -- the start-up handshake (over a multiprocessing pipe) -------------------------------------------
class CoreReady(msgspec.Struct, tag=True):
    config: EngineConfig  # resolved: max_model_len, device, dtype, ... as the core runs them
    vocab_size: int
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True):
    error: str


Handshake = CoreReady | CoreFailed


__all__ = ["EngineRequest", "SeqOutput", "EngineStats", "AddRequests", "AbortRequests", "Shutdown", "CoreInput",
           "StepOutputs", "EngineDead", "CoreOutput", "CoreReady", "CoreFailed", "Handshake"]
