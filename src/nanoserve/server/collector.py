"""RequestCollector: one API request's outputs on their way from the engine client's reader to its handler.

The reader task puts each RequestOutput (one per prompt of the request, as the front end made it) the moment it
arrives and never waits; the handler takes whatever accumulated since its last take: the front end's own objects,
passed through. A consumer that falls behind (a slow client, a busy event loop) gets fewer, bigger deltas instead
of a growing queue: a later output of the same prompt folds into the one waiting (its token ids and logprobs
appended in place), and the engine never waits on HTTP. Folded text is gathered as pieces and joined once per
take, so a long non-streamed answer costs O(length), not O(length²).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from nanoserve.engine.output import RequestOutput


class EngineError(RuntimeError):
    """The engine side ended the request, not anything in it (answered 5xx)."""


class EngineDeadError(EngineError):
    """The engine core process died or failed; every request in flight gets this."""


class EngineStoppedError(EngineError):
    """The engine is not running (not started yet, shutting down, or dead)."""


class RequestRejectedError(ValueError):
    """The engine core refused the request (answered 400)."""


class RequestCollector:
    """The prompts × n completions of one API request. put()/fail() from the reader; get()/result() by the handler."""

    def __init__(self, request_ids: list[str], prompt_token_ids: list[list[int]], n: int,
                 on_close: Callable[[RequestCollector], None],
                 observer: Callable[[int, RequestOutput], None] | None = None):
        self.request_ids, self.prompt_token_ids, self.n = request_ids, prompt_token_ids, n
        self._on_close, self._observer = on_close, observer
        self._pending: dict[int, RequestOutput] = {}  # prompt index → what arrived since the last take
        self._pieces: dict[tuple[int, int], list[str]] = {}  # (prompt, completion) → folded text, joined on take
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
            self.num_completion_tokens += len(c.token_ids)
        pending = self._pending.get(index)
        if pending is None:
            self._pending[index] = out
        else:
            self._fold(index, pending, out)
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

    def _fold(self, index: int, pending: RequestOutput, later: RequestOutput) -> None:
        """Append a later delta of prompt `index` to the one not taken yet (its lists are the front end's fresh
        slices, owned by this request)."""
        mine = {c.index: c for c in pending.outputs}
        for c in later.outputs:
            into = mine.get(c.index)
            if into is None:
                pending.outputs.append(c)
                continue
            if c.text:
                pieces = self._pieces.get((index, c.index))
                if pieces is None:
                    pieces = self._pieces[index, c.index] = [into.text]
                pieces.append(c.text)
            into.token_ids += c.token_ids
            if c.logprobs is not None:
                if into.logprobs is None:
                    into.logprobs = c.logprobs
                else:
                    into.logprobs += c.logprobs
            if c.finish_reason is not None:
                into.finish_reason, into.stop_reason = c.finish_reason, c.stop_reason
            into.cumulative_logprob = c.cumulative_logprob
        pending.finished = later.finished
        pending.num_cached_tokens = max(pending.num_cached_tokens, later.num_cached_tokens)
        pending.error = pending.error or later.error
        pending.prompt_logprobs = pending.prompt_logprobs or later.prompt_logprobs

    # -- handler side -----------------------------------------------------------------------------
    async def get(self) -> list[tuple[int, RequestOutput]]:
        """(prompt index, its RequestOutput) for what arrived since the last call, once something did, in choice
        order. Raises the request's error."""
        await self._ready.wait()
        self._ready.clear()
        if self.error is not None:
            raise self.error
        return self._take()

    async def result(self) -> list[tuple[int, RequestOutput]]:
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

    def _take(self) -> list[tuple[int, RequestOutput]]:
        pending, self._pending = self._pending, {}
        for (i, j), pieces in self._pieces.items():
            next(c for c in pending[i].outputs if c.index == j).text = "".join(pieces)
        self._pieces.clear()
        for out in pending.values():
            if len(out.outputs) > 1:
                out.outputs.sort(key=lambda c: c.index)
        return sorted(pending.items())


__all__ = ["RequestCollector", "EngineError", "EngineDeadError", "EngineStoppedError",
           "RequestRejectedError"]
