"""LLM: the offline API. generate() returns finished outputs in input order; stream() yields deltas."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import LLMEngine
from nanoserve.engine.output import CompletionOutput, RequestOutput
from nanoserve.engine.prompts import Prompt, as_prompt_list
from nanoserve.hub import resolve_config
from nanoserve.sampling import SamplingParams

StreamDelta = CompletionOutput  # what one step added to one completion of a streamed request


class LLM:
    """`LLM(model, **engine_options)`: a model folder, .gguf file or hub id (org/name; `revision`, `download_dir`);
    options are EngineConfig fields (unknown ones are errors)."""

    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(resolve_config(EngineConfig.from_kwargs(model, **engine_options)))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine (its histogram is written when cudagraph_plan is set); the LLM is unusable after."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_ids.append(f"gen-{next(self._ids)}")
                self.engine.add_request(request_ids[-1], prompt, p, stream=False)
        except Exception:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            while len(results) < len(prompts):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in request_ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield each completion's new text and tokens as they are produced (other requests keep running)."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params or SamplingParams())
        try:
            finished = False
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield from out.outputs
        finally:
            self.engine.abort_request(request_id)  # no-op once finished; frees blocks if the caller stopped early
