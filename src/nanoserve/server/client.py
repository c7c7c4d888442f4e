"""EngineClient: the server's front end (engine/frontend.py, the same one the offline LLM runs) over the engine
core in a process of its own (engine/core_client.MPClient).

add() submits one API request (its prompts × n) and returns its RequestCollector. The MPClient's reader task,
on the event loop, hands each step's deltas to the front end, which turns them into RequestOutputs; each goes
to its request's collector as it is, which merges whatever its handler has not taken yet: the reader never
waits on a client. If the core dies, every request in flight fails with EngineDeadError and the death
callbacks run (the server stops and exits non-zero).
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from nanoserve.config import EngineConfig
from nanoserve.engine.core_client import CoreUnreachableError, EngineStartError, MPClient  # noqa: F401 (re-exported)
from nanoserve.engine.frontend import FrontEnd
from nanoserve.engine.messages import SeqOutput
from nanoserve.engine.output import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.server.collector import EngineDeadError, EngineStoppedError, RequestCollector

logger = logging.getLogger("nanoserve.server")


class EngineClient(FrontEnd):
    def __init__(self, config: EngineConfig, tokenizer=None, log_level: str = "info", hf_config=None):
        """Start the engine core process and wait until it is ready (EngineStartError: why it could not start)."""
        self.core_client: MPClient = MPClient(config, log_level, hf_config)
        super().__init__(self.core_client, tokenizer)
        self._collectors: dict[str, tuple[RequestCollector, int]] = {}  # front-end request id → (collector, prompt)
        self._death_callbacks: list[Callable[[], None]] = []
        self._dead_reason: str | None = None
        self._ended: str | None = None  # end_requests() was called: why
        self._closing = self._died = False

    # -- state --------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.core_client.connected and self._dead_reason is None

    @property
    def is_dead(self) -> bool:
        """The core died or failed while serving (not: shut down in order)."""
        return self._died

    @property
    def core_pid(self) -> int | None:
        return self.core_client.process.pid

    def has_unfinished_requests(self) -> bool:
        return bool(self._collectors)

    def add_death_callback(self, callback: Callable[[], None]) -> None:
        """Called (on the event loop) once if the core dies while serving."""
        self._death_callbacks.append(callback)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the core and start reading its outputs (on the event loop that will serve requests)."""
        if self.core_client.connected or self._dead_reason is not None:
            return
        await self.core_client.start(self._deliver, self._die)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core in order; requests left fail with EngineStoppedError."""
        if self._closing:
            return
        self._closing = True
        await self.core_client.shutdown(timeout)
        self._die("the server is shutting down")

    # -- requests -----------------------------------------------------------------------------------
    def add(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, prefix: str = "req",
            observer: Callable[[int, RequestOutput], None] | None = None) -> RequestCollector:
        """Submit one API request (its prompts, already tokenized) as len(prompts) × n core sequences. Raises
        EngineStoppedError, QueueFullError when too many sequences wait already, or RequestError."""
        if not self.is_running or self._ended is not None:
            raise EngineStoppedError(self._dead_reason or self._ended or "the engine is not running")
        base = f"{prefix}-{uuid.uuid4().hex}"
        request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        try:
            self.add_requests(request_ids, prompts, params, stream=True)
        except CoreUnreachableError as e:
            raise EngineStoppedError(str(e)) from None
        collector = RequestCollector(request_ids, [ids for _, ids in prompts], params.n, self._close, observer)
        for i, rid in enumerate(request_ids):
            self._collectors[rid] = (collector, i)
        return collector

    def _close(self, collector: RequestCollector) -> None:
        """A collector's handler is done with it: abort its unfinished sequences in the core (frees their blocks)."""
        ids = [rid for rid in collector.request_ids if self._collectors.pop(rid, None) is not None]
        aborts = self.abort_requests(ids)
        if aborts and self.is_running:
            try:
                self.core_client.abort_requests(aborts)
            except CoreUnreachableError:
                pass

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        collectors = self._collectors
        for out in self.process_outputs(outputs):
            entry = collectors.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del collectors[out.request_id]
            entry[0].put(entry[1], out)

    def end_requests(self, reason: str) -> int:
        """End every request in flight with EngineStoppedError(reason) (the server's drain deadline passed); their
        handlers answer it and close them, which aborts them in the core. The number of API requests ended."""
        self._ended = reason  # and any request a handler submits later
        collectors = {id(c): c for c, _ in self._collectors.values()}
        for collector in collectors.values():
            collector.fail(EngineStoppedError(reason))
        return len(collectors)

    # -- death ----------------------------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        """Fail every request in flight; once, the first reason wins."""
        if self._dead_reason is not None:
            return
        self._dead_reason, self._died = reason, not self._closing
        error: Exception = EngineStoppedError(reason) if self._closing else EngineDeadError(reason)
        collectors = {id(c): c for c, _ in self._collectors.values()}
        if not self._closing:
            logger.error("%s; failing %d request(s) in flight", reason, len(collectors))
        self.abort_requests(list(self._collectors))
        self._collectors.clear()
        for collector in collectors.values():
            collector.fail(error)
        if not self._closing:
            for callback in self._death_callbacks:
                callback()


__all__ = ["EngineClient", "EngineStartError"]
