"""LLMEngine: the engine core in this process with the front end around it (the offline LLM's engine).

add_request() tokenizes and fans out; step() runs one core step and turns its per-step deltas into
RequestOutputs (deltas for streamed requests, the whole result once for the others); a stop string
found by the front end aborts its core sequence at once. The server runs the same front end in the API
process over a core in its own process (server/).
"""
from __future__ import annotations

import logging

from nanoserve.config import EngineConfig
from nanoserve.engine import grammar
from nanoserve.engine.core import EngineCore
from nanoserve.engine.messages import EngineStats
from nanoserve.engine.output import OutputProcessor, RequestOutput
from nanoserve.engine.prompts import Prompt, QueueFullError, check_queue, tokenize  # noqa: F401 (re-exported)
from nanoserve.model_files import load_tokenizer
from nanoserve.sampling import SamplingParams

logger = logging.getLogger("nanoserve")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config = self.core.config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        self.output_processor = OutputProcessor(self.tokenizer)

    # the parts tests and benchmarks look at
    @property
    def model_runner(self):
        return self.core.runner

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.core.eos_token_ids

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    stream: bool = True) -> None:
        """Queue a request. stream=False: step() reports it only once finished (with its whole text)."""
        params = params or SamplingParams()
        check_queue(len(self.core.scheduler.waiting), params.n, self.config.max_waiting_requests)
        grammar.check(params.structured_outputs)  # a bad schema, regex or grammar: a ValueError naming it
        text, ids = tokenize(self.tokenizer, prompt, self.vocab_size, self.config.max_model_len)
        core_requests = self.output_processor.add_request(request_id, text, ids, params, stream)
        try:
            for r in core_requests:
                self.core.add_request(r)
        except ValueError:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def close(self) -> None:
        self.core.close()

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process(self.core.step())
        if processed.aborts:
            self.core.abort_requests(processed.aborts)
        return processed.outputs
