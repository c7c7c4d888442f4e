"""AsyncEngine: LLMEngine.step() on one background thread, outputs delivered to asyncio queues.

GPU work blocks, so the engine never runs on the event loop. The event loop talks to the engine
thread only through a command queue (add / abort) that the thread drains before every step, so
the engine itself is only ever touched by one thread. The thread answers through
loop.call_soon_threadsafe into one asyncio.Queue per stream. Idle, the thread sleeps on an Event.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from dataclasses import dataclass

import torch

from nanoserve.engine.engine import LLMEngine, RequestOutput
from nanoserve.sampling import SamplingParams

logger = logging.getLogger("nanoserve.server")

Prompt = str | list[int]


class EngineError(RuntimeError):
    """A request was ended by the engine side, not by anything in the request (the server answers 5xx)."""


class EngineStepError(EngineError):
    """engine.step() raised: every in-flight request was aborted; the engine keeps serving new ones."""


class EngineStoppedError(EngineError):
    """The engine thread is not running (not started yet, or shut down)."""


class RequestStream:
    """The outputs of a group of engine requests (one per prompt) as (prompt index, RequestOutput).

    Outputs are cumulative, like LLMEngine.step()'s. Iteration ends when every request has
    finished; it raises an EngineError if the engine failed or stopped under it. close() aborts whatever is
    unfinished (and frees its KV blocks): call it in a finally block, it is a no-op when done.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = request_ids
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()  # the engine thread has already dropped every request of this stream
            raise item
        index, output = item
        if output.finished:
            self._unfinished.discard(index)
        return item

    def close(self) -> None:
        if self._unfinished:
            self._engine.abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()

    def _put(self, item) -> None:
        """Engine thread → event loop. Raises RuntimeError when the loop is closed."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


@dataclass
class _Add:
    prompts: list[tuple[str, Prompt, SamplingParams]]
    stream: RequestStream
    done: asyncio.Future  # resolved on the stream's loop: None, or the engine's exception


@dataclass
class _Abort:
    request_ids: list[str]


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():  # the awaiting handler may have been cancelled meanwhile
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


class AsyncEngine:
    """Owns an LLMEngine and the one thread allowed to touch it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # engine thread only
        self._stats = copy.copy(engine.stats)
        # the engine made its device current on this (the constructing) thread; the engine thread repeats that
        on_cuda = engine.config.torch_device.type == "cuda"
        self._cuda_device = torch.cuda.current_device() if on_cuda else None
        self.step_errors = 0

    # ---- event-loop side -------------------------------------------------------------------

    @property
    def stats(self):
        """EngineStats as of the end of the last engine step (a copy; safe to read from any thread)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def start(self) -> None:
        if self.is_running:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; in-flight requests end with EngineStoppedError."""
        self._stop = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def add(self, prompts: list[tuple[str, Prompt, SamplingParams]]) -> RequestStream:
        """Queue requests (all or none). Raises what LLMEngine.add_request raises: ValueError for a bad
        request, QueueFullError when too many are waiting; EngineStoppedError when not running."""
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, [rid for rid, _, _ in prompts], loop)
        done = loop.create_future()
        self._send(_Add(prompts, stream, done))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(stream.request_ids)  # queued after the add, so it cannot overtake it
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (frees their KV blocks). Unknown or finished ids are ignored."""
        if request_ids:
            self._send(_Abort(list(request_ids)))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        if self._cuda_device is not None:  # the current CUDA device is per thread: launch where the cache lives
            torch.cuda.set_device(self._cuda_device)
        logger.info("engine thread started")
        while True:
            self._wakeup.clear()  # cleared before draining: a command sent after this sets it again
            self._drain_commands()
            if self._stop:
                break
            if not self.engine.has_unfinished_requests():
                self._snapshot_stats()
                self._wakeup.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail what was in flight, not the server
                self.step_errors += 1
                logger.exception("engine.step() failed; aborting %d in-flight request(s)", len(self._streams))
                self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            else:
                self._deliver(outputs)
            self._snapshot_stats()
        self._fail_all(EngineStoppedError("the engine was shut down"))
        # commands queued after the final drain: answer them so no handler waits forever
        self._drain_commands()
        self._snapshot_stats()
        logger.info("engine thread stopped")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if isinstance(cmd, _Add):
                    self._add(cmd)
                else:
                    for rid in cmd.request_ids:
                        if self._streams.pop(rid, None) is not None:
                            self.engine.abort_request(rid)
            except Exception:
                logger.exception("engine command %s failed", type(cmd).__name__)

    def _add(self, cmd: _Add) -> None:
        loop = cmd.stream._loop
        if self._stop:
            loop.call_soon_threadsafe(_resolve, cmd.done, EngineStoppedError("the engine was shut down"))
            return
        added: list[str] = []
        try:
            for rid, prompt, params in cmd.prompts:
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception as e:
            for rid in added:
                self.engine.abort_request(rid)
            loop.call_soon_threadsafe(_resolve, cmd.done, e)
            return
        for i, rid in enumerate(added):
            self._streams[rid] = (cmd.stream, i)
        try:
            loop.call_soon_threadsafe(_resolve, cmd.done, None)
        except RuntimeError:  # the loop is gone
            self._drop(added)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:  # aborted while the step ran
                continue
            stream, index = entry
            if out.finished:
                del self._streams[out.request_id]
            try:
                stream._put((index, out))
            except RuntimeError:
                self._drop([out.request_id])

    def _drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)

    def _fail_all(self, error: Exception) -> None:
        streams = self._streams
        self._streams = {}
        for rid, (stream, _) in streams.items():
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            try:
                stream._put(error)
            except RuntimeError:
                pass

    def _snapshot_stats(self) -> None:
        try:
            self._stats = copy.copy(self.engine.stats)
        except Exception:
            logger.exception("reading engine.stats failed")
