"""RequestCollector: one API request's deltas on their way from the engine client's reader to its handler.

The reader task puts each RequestOutput delta (one per prompt of the request) the moment it arrives and
never waits; the handler takes whatever accumulated since its last take. A consumer that falls behind (a
slow client, a busy event loop) therefore gets fewer, bigger deltas instead of a growing queue, and the
engine never waits on HTTP. Text is gathered as pieces and joined once per take, so a long non-streamed
answer costs O(length), not O(length²).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.engine.output import CompletionOutput, RequestOutput


class EngineError(RuntimeError):
    """The engine side ended the request, not anything in it (answered 5xx)."""


class EngineDeadError(EngineError):
    """The engine core process died or failed; every request in flight gets this."""


class EngineStoppedError(EngineError):
    """The engine is not running (not started yet, shutting down, or dead)."""


class RequestRejectedError(ValueError):
    """The engine core refused the request (answered 400)."""


@dataclass
class _Pending:
    """One completion's new tokens and text since the last take."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0

    def add(self, c: CompletionOutput) -> None:
        if c.text:
            self.texts.append(c.text)
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += c.logprobs
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        self.cumulative_logprob = c.cumulative_logprob

    def output(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, "".join(self.texts), self.token_ids, self.finish_reason, self.stop_reason,
                                self.logprobs, self.cumulative_logprob)


@dataclass
class Delta:
    """What one completion of one prompt added since the last take (its choice index: prompt * n + completion)."""

    prompt_index: int
    output: CompletionOutput


class RequestCollector:
    """The prompts × n completions of one API request. put()/fail() from the reader; get()/result() by the handler."""

    def __init__(self, request_ids: list[str], prompt_token_ids: list[list[int]], n: int,
                 on_close: Callable[[RequestCollector], None],
                 observer: Callable[[int, RequestOutput], None] | None = None):
        self.request_ids, self.prompt_token_ids, self.n = request_ids, prompt_token_ids, n
        self._on_close, self._observer = on_close, observer
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._unfinished = set(range(len(request_ids)))
        self._ready, self._done = asyncio.Event(), asyncio.Event()
        self.error: Exception | None = None
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0
        self.prompt_logprobs: dict[int, list] = {}  # prompt index → RequestOutput.prompt_logprobs, when asked
        self.closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    # -- reader side ------------------------------------------------------------------------------
    def put(self, index: int, out: RequestOutput) -> None:
        if self._observer is not None:
            self._observer(index, out)
        for c in out.outputs:
            pending = self._pending.get((index, c.index))
            if pending is None:
                pending = self._pending[index, c.index] = _Pending()
            pending.add(c)
            self.num_completion_tokens += len(c.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[index] = out.prompt_logprobs
        if out.error is not None and self.error is None:
            self.error = RequestRejectedError(out.error)
        if out.finished:
            self._unfinished.discard(index)
            if not self._unfinished:
                self._done.set()
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """End the request with `error` (the engine died or stopped); the handler raises it."""
        if self.error is None:
            self.error = error
        self._unfinished.clear()
        self._ready.set()
        self._done.set()

    # -- handler side -----------------------------------------------------------------------------
    async def get(self) -> list[Delta]:
        """What arrived since the last call, once something did (in choice order). Raises the request's error."""
        await self._ready.wait()
        self._ready.clear()
        if self.error is not None:
            raise self.error
        return self._take()

    async def result(self) -> list[Delta]:
        """Everything, once every prompt finished. Raises the request's error."""
        await self._done.wait()
        if self.error is not None:
            raise self.error
        return self._take()

    def close(self) -> None:
        """Abort what is unfinished (the client left, or the handler ended); a no-op after the first call."""
        if not self.closed:
            self.closed = True
            self._on_close(self)

    def _take(self) -> list[Delta]:
        pending, self._pending = self._pending, {}
        return [Delta(i, p.output(j)) for (i, j), p in sorted(pending.items())]


__all__ = ["RequestCollector", "Delta", "EngineError", "EngineDeadError", "EngineStoppedError",
           "RequestRejectedError"]
