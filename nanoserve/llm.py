"""LLM: the offline API. generate() returns finished outputs in input order; stream() yields deltas."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import LLMEngine, RequestOutput
from nanoserve.sampling import SamplingParams

Prompt = str | list[int]


@dataclass
class StreamDelta:
    """What one step added to one completion of a streamed request."""

    index: int
    text: str  # new text (may be "" while characters are held back)
    token_ids: list[int]  # new token ids
    finish_reason: str | None


class LLM:
    """`LLM(model_dir_or_gguf_file, **engine_options)`; options are EngineConfig fields (unknown ones are errors)."""

    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
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
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        try:
            finished = False
            while not finished:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    finished = out.finished
                    for c in out.outputs:
                        text, tokens = c.text[sent_text.get(c.index, 0):], c.token_ids[sent_tokens.get(c.index, 0):]
                        if c.index in done:
                            continue
                        if c.finish_reason:
                            done.add(c.index)
                        if text or tokens or c.finish_reason:
                            sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                            yield StreamDelta(c.index, text, tokens, c.finish_reason)
        finally:
            self.engine.abort_request(request_id)  # no-op once finished; frees blocks if the caller stopped early


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
