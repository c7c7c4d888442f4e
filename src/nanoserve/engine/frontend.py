"""FrontEnd: what stands between a user's request and the engine core, written once for the offline LLM and the
server (vLLM V1's shape: one front end over a core client, in-process or over ZeroMQ).

It validates (the request's token ids against the vocabulary, prompts through engine/prompts.py), applies
max_waiting_requests (one check, counted by the output processor: sequences submitted that have produced
nothing yet), fans a request with n completions out into n core sequences, and turns the core's per-step deltas
into RequestOutputs (engine/output.py), aborting in the core what a stop string ended. The core client
(engine/core_client.py) decides only where the core runs: LLMEngine steps an InprocClient, the server's
EngineClient feeds the deltas an MPClient reads into process_outputs() on its event loop. Nothing here waits on
the core. A bad request raises RequestError (errors.py) with the field at fault as data.
"""
from __future__ import annotations

import dataclasses

from nanoserve.engine.core_client import CoreClient
from nanoserve.engine.messages import EngineStats, SeqOutput
from nanoserve.engine.output import OutputProcessor, RequestOutput
from nanoserve.engine.prompts import Prompt, check_params_token_ids, check_queue, tokenize
from nanoserve.sampling import SamplingParams


class FrontEnd:
    def __init__(self, core_client: CoreClient, tokenizer):
        self.core_client, self.tokenizer = core_client, tokenizer
        self.config = core_client.config
        self.vocab_size: int = core_client.vocab_size
        self.max_waiting_requests = self.config.max_waiting_requests
        self.output_processor = OutputProcessor(tokenizer)

    @property
    def stats(self) -> EngineStats:
        """The core's live state and counters (the latest the core sent, when it runs in its own process)."""
        return self.core_client.stats

    # -- validation -----------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt checked against this model's limits (RequestError on "prompt")."""
        return tokenize(self.tokenizer, prompt, self.vocab_size, self.config.max_model_len, add_special_tokens)

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """params fitted to this model: token ids within the vocabulary (else RequestError naming the field); a
        top_k as large as the vocabulary keeps every token, the same as off (and the sampler's int32 stays in
        range)."""
        check_params_token_ids(params, self.vocab_size)
        return dataclasses.replace(params, top_k=0) if params.top_k >= self.vocab_size else params

    def check_fits(self, num_seqs: int) -> None:
        """A request of num_seqs sequences could wait at all (RequestError on "n" if not): the cheap refusal a
        front end can make before tokenizing."""
        check_queue(0, num_seqs, self.max_waiting_requests)

    # -- requests --------------------------------------------------------------------------------------
    def add_requests(self, request_ids: list[str], prompts: list[tuple[str | None, list[int]]],
                     params: SamplingParams, stream: bool) -> None:
        """Submit one request per (text, token ids) prompt, each as params.n core sequences. QueueFullError when
        they do not fit beside those waiting; a refusal by an in-process core raises here (and leaves nothing)."""
        check_queue(self.output_processor.num_waiting, len(prompts) * params.n, self.max_waiting_requests)
        params = self.check_params(params)
        core_requests = []
        try:
            for rid, (text, ids) in zip(request_ids, prompts, strict=True):
                core_requests += self.output_processor.add_request(rid, text, ids, params, stream)
            self.core_client.add_requests(core_requests)
        except Exception:
            for rid in request_ids:
                self.output_processor.abort_request(rid)
            raise

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests; the core sequences still running, which the caller aborts in the core (or has
        already lost, when the core is gone)."""
        aborts: list[str] = []
        for rid in request_ids:
            aborts += self.output_processor.abort_request(rid)
        return aborts

    def process_outputs(self, outputs: list[SeqOutput]) -> list[RequestOutput]:
        """One step's deltas → RequestOutputs; sequences a stop string ended are aborted in the core at once."""
        processed = self.output_processor.process(outputs)
        if processed.aborts:
            self.core_client.abort_requests(processed.aborts)
        return processed.outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()


__all__ = ["FrontEnd"]
