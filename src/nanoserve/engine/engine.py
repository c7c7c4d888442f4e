"""LLMEngine: the front end (engine/frontend.py) over the engine core in this process (the offline LLM's engine).

add_request() tokenizes, validates and fans out; step() runs one core step through the InprocClient and turns its
per-step deltas into RequestOutputs (deltas for streamed requests, the whole result once for the others). The
server runs the same front end in the API process over an MPClient to a core in its own process (server/client.py).
`core` is the in-process EngineCore (InprocClient.core), for tools and tests that look inside (its runner,
scheduler, block manager); every call of the front end goes through the client.
"""
from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine import grammar
from nanoserve.engine.core import EngineCore
from nanoserve.engine.core_client import InprocClient
from nanoserve.engine.frontend import FrontEnd
from nanoserve.engine.output import RequestOutput
from nanoserve.engine.prompts import Prompt, QueueFullError  # noqa: F401 (re-exported)
from nanoserve.model_files import load_tokenizer
from nanoserve.sampling import SamplingParams


class LLMEngine(FrontEnd):
    def __init__(self, config: EngineConfig):
        client = InprocClient(EngineCore(config))
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        super().__init__(client, tokenizer)
        self.core_client: InprocClient = client

    @property
    def core(self) -> EngineCore:
        return self.core_client.core

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    stream: bool = True) -> None:
        """Queue a request. stream=False: step() reports it only once finished (with its whole text)."""
        params = params or SamplingParams()
        self.check_fits(params.n)
        grammar.check(params.structured_outputs)  # a bad schema, regex or grammar: a ValueError naming it
        self.add_requests([request_id], [self.tokenize(prompt)], params, stream)

    def abort_request(self, request_id: str) -> None:
        self.core_client.abort_requests(self.abort_requests([request_id]))

    def close(self) -> None:
        self.core_client.close()

    def step(self) -> list[RequestOutput]:
        return self.process_outputs(self.core_client.step())
