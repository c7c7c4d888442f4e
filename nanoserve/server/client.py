"""EngineClient: the API process's end of the engine core, which runs in a process of its own.

Construction spawns the core (engine/core_process.py, multiprocessing's spawn context) and waits for
its start-up handshake: the resolved config and limits, or the one-line reason it could not start
(EngineStartError). start(), on the server's event loop, connects the two ZeroMQ sockets and starts one
task that reads the core's per-step outputs, turns them into text through the OutputProcessor (the
same front end the offline LLM uses) and puts each request's deltas into its RequestCollector, which
merges them while its handler is busy: the reader never waits on a client.

Sends never block (unbounded queue; the core drains its input every step). If the core process dies,
its exit is seen at once (its process sentinel is watched by the event loop): every request in flight
fails with EngineDeadError and the death callbacks run (the server stops and exits non-zero).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from nanoserve.config import EngineConfig
from nanoserve.engine.core_process import (AbortRequests, AddRequests, CoreFailed, CoreOutput, EngineDead, Handshake,
                                           Shutdown, run_engine_core)
from nanoserve.engine.messages import EngineStats, SeqOutput
from nanoserve.engine.output import OutputProcessor, RequestOutput
from nanoserve.engine.prompts import check_queue
from nanoserve.sampling import SamplingParams
from nanoserve.server.collector import EngineDeadError, EngineStoppedError, RequestCollector

logger = logging.getLogger("nanoserve.server")

DEATH_GRACE_S = 0.1  # after the process exits, a moment for its last message (EngineDead: the reason) to arrive
MAX_DRAIN_S = 0.02  # the longest the output reader runs without letting the HTTP handlers write


class EngineStartError(ValueError):
    """The engine core could not start; the message says why in one line."""


class EngineClient:
    def __init__(self, config: EngineConfig, tokenizer=None, log_level: str = "info", hf_config=None):
        """Start the engine core process and wait until it is ready (model loaded, graphs captured).
        hf_config: the model's config, checked already (engine/preflight.py), so the core need not read it."""
        started = time.monotonic()
        self._dir = tempfile.mkdtemp(prefix="nanoserve-")
        self._addresses = (f"ipc://{self._dir}/input", f"ipc://{self._dir}/output")
        spawn = multiprocessing.get_context("spawn")
        receiver, sender = spawn.Pipe(duplex=False)
        # not daemonic: a daemonic process may not start the tensor-parallel worker ranks; the core leaves when its
        # parent is gone (core_process.py), and the finalizer below stops it with the client
        self._process = spawn.Process(target=run_engine_core, args=(config, *self._addresses, sender, log_level, hf_config),
                                      name="nanoserve-engine-core", daemon=False)
        self._finalizer = weakref.finalize(self, _stop_process, self._process, self._dir)
        try:
            self._process.start()
            sender.close()
            ready = self._handshake(receiver)
        except BaseException:
            self._finalizer()
            raise
        finally:
            receiver.close()
        self.config: EngineConfig = ready.config
        self.vocab_size: int = ready.vocab_size
        self.stats: EngineStats = ready.stats  # as of the core's latest message
        self.max_waiting_requests = self.config.max_waiting_requests
        self.output_processor = OutputProcessor(tokenizer)
        self._collectors: dict[str, tuple[RequestCollector, int]] = {}  # processor request id → (collector, prompt)
        self._unstarted: set[str] = set()  # core sequences sent that have not produced a token yet
        self._death_callbacks: list[Callable[[], None]] = []
        self._dead_reason: str | None = None
        self._ended: str | None = None  # end_requests() was called: why
        self._running = self._closing = self._died = False
        self._reader: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        logger.info("engine core ready in %.1f s (pid %d)", time.monotonic() - started, self._process.pid)

    def _handshake(self, receiver) -> Handshake:
        while not receiver.poll(0.2):
            if not self._process.is_alive() and not receiver.poll(0):
                raise EngineStartError(f"the engine core process exited while starting ({_exit_text(self._process)})")
        try:
            message = msgspec.msgpack.decode(receiver.recv_bytes(), type=Handshake)
        except EOFError:
            self._process.join(5)
            raise EngineStartError(f"the engine core process exited while starting ({_exit_text(self._process)})") \
                from None
        if isinstance(message, CoreFailed):
            self._process.join(5)
            raise EngineStartError(message.error)
        return message

    # -- state --------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._running and self._dead_reason is None

    @property
    def is_dead(self) -> bool:
        """The core died or failed while serving (not: shut down in order)."""
        return self._died

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    def has_unfinished_requests(self) -> bool:
        return bool(self._collectors)

    def add_death_callback(self, callback: Callable[[], None]) -> None:
        """Called (on the event loop) once if the core dies while serving."""
        self._death_callbacks.append(callback)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the core and start reading its outputs (on the event loop that will serve requests)."""
        if self._running or self._dead_reason is not None:
            return
        loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        self._input = zmq.Context.shadow(self._context).socket(zmq.PUSH)  # sync: sends never block
        self._output = self._context.socket(zmq.PULL)
        for sock, option in ((self._input, zmq.SNDHWM), (self._output, zmq.RCVHWM)):
            sock.setsockopt(option, 0)  # unbounded: the peer drains it every step
            sock.setsockopt(zmq.LINGER, 0)
        self._input.connect(self._addresses[0])
        self._output.connect(self._addresses[1])
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._reader = asyncio.create_task(self._read_outputs(), name="nanoserve-engine-outputs")
        self._running = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core in order (Shutdown, then terminate if it does not leave); requests left fail."""
        if self._closing:
            return
        self._closing = True
        if self._running and self._process.is_alive():
            try:
                self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._process.join, timeout)
        self._die("the server is shutting down")
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._running:
            asyncio.get_running_loop().remove_reader(self._process.sentinel)
            self._input.close()
            self._output.close()
            self._context.term()
        self._running = False
        self._finalizer()

    # -- requests -----------------------------------------------------------------------------------
    def add(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, prefix: str = "req",
            observer: Callable[[int, RequestOutput], None] | None = None) -> RequestCollector:
        """Submit one API request (its prompts, already validated and tokenized) as len(prompts) × n core
        sequences. Raises EngineStoppedError, or QueueFullError when too many sequences wait already."""
        if not self.is_running or self._ended is not None:
            raise EngineStoppedError(self._dead_reason or self._ended or "the engine is not running")
        num_seqs = len(prompts) * params.n
        check_queue(len(self._unstarted), num_seqs, self.max_waiting_requests)
        base = f"{prefix}-{uuid.uuid4().hex}"
        request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        collector = RequestCollector(request_ids, [ids for _, ids in prompts], params.n, self._close, observer)
        core_requests = []
        for i, (rid, (text, ids)) in enumerate(zip(request_ids, prompts)):
            core_requests += self.output_processor.add_request(rid, text, ids, params, stream=True)
            self._collectors[rid] = (collector, i)
        self._unstarted.update(r.request_id for r in core_requests)
        try:
            self._send(AddRequests(core_requests))
        except EngineStoppedError:
            collector.close()
            raise
        return collector

    def _close(self, collector: RequestCollector) -> None:
        """A collector's handler is done with it: abort its unfinished sequences in the core (frees their blocks)."""
        aborts: list[str] = []
        for rid in collector.request_ids:
            if self._collectors.pop(rid, None) is not None:
                aborts += self.output_processor.abort_request(rid)
        self._unstarted.difference_update(aborts)
        if aborts and self.is_running:
            try:
                self._send(AbortRequests(aborts))
            except EngineStoppedError:
                pass

    def _send(self, message) -> None:
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise EngineStoppedError(f"the engine core cannot be reached: {e}") from None

    # -- the reader task ----------------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        """A message already queued is returned without yielding: a reader that fell behind drains the queue
        (merging it into the collectors) before the handlers write again; after MAX_DRAIN_S of that it lets
        them write what has merged so far."""
        decoder = msgspec.msgpack.Decoder(CoreOutput)
        try:
            drain_start = time.monotonic()
            while True:
                if time.monotonic() - drain_start > MAX_DRAIN_S:
                    await asyncio.sleep(0)
                    drain_start = time.monotonic()
                waits = not self._output.get(zmq.EVENTS) & zmq.POLLIN
                frame = await self._output.recv(copy=False)
                if waits:  # the event loop ran the handlers meanwhile
                    drain_start = time.monotonic()
                message = decoder.decode(frame.buffer)
                if isinstance(message, EngineDead):
                    self._die(message.reason)
                    return
                self.stats = message.stats
                if message.outputs:
                    self._deliver(message.outputs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reading the engine core's outputs failed")
            self._die(f"reading the engine core's outputs failed: {type(e).__name__}: {e}")

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        unstarted = self._unstarted
        for out in outputs:
            unstarted.discard(out.request_id)
        processed = self.output_processor.process(outputs)
        if processed.aborts:  # stop strings ended these sequences
            self._send(AbortRequests(processed.aborts))
        collectors = self._collectors
        for out in processed.outputs:
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
    def _on_process_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        if not self._closing:
            loop.call_later(DEATH_GRACE_S, self._core_exited)

    def _core_exited(self) -> None:
        self._process.join(1.0)  # its pipes close a moment before it can be reaped
        self._die(f"the engine core process died unexpectedly ({_exit_text(self._process)})")

    def _die(self, reason: str) -> None:
        """Fail every request in flight; once, the first reason wins."""
        if self._dead_reason is not None:
            return
        self._dead_reason, self._died = reason, not self._closing
        error: Exception = EngineStoppedError(reason) if self._closing else EngineDeadError(reason)
        collectors = {id(c): c for c, _ in self._collectors.values()}
        if not self._closing:
            logger.error("%s; failing %d request(s) in flight", reason, len(collectors))
        for rid in list(self._collectors):
            self.output_processor.abort_request(rid)
        self._collectors.clear()
        self._unstarted.clear()
        for collector in collectors.values():
            collector.fail(error)
        if not self._closing:
            for callback in self._death_callbacks:
                callback()


def _exit_text(process) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _stop_process(process, directory: str) -> None:
    """Last resort (garbage collection, interpreter exit, failed start-up): the core must not outlive us."""
    if process.pid is not None and process.is_alive():
        process.kill()  # it ignores SIGTERM (core_process.py)
        process.join(5)
    shutil.rmtree(directory, ignore_errors=True)


__all__ = ["EngineClient", "EngineStartError"]
