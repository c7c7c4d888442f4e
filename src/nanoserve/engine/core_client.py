"""The engine core as the front end (engine/frontend.py) sees it, in this process or in one of its own.

CoreClient is the small protocol: the core's resolved config and limits, its latest stats, and two calls that
never wait on it: add_requests() and abort_requests(). Outputs come back one way per client:
InprocClient.step() runs a core step here (the offline LLM); MPClient's reader task, on the event loop, hands
every step's SeqOutputs to a callback as they arrive (the server).

MPClient: construction spawns the core (engine/core_process.py, multiprocessing's spawn context) and waits for its
start-up handshake: the resolved config and limits, or the one-line reason it could not start (EngineStartError).
start(), on the event loop, connects the two ZeroMQ sockets and starts the reader task. Sends never block
(unbounded queue; the core drains its input every step). If the core process dies, its exit is seen at once (its
process sentinel is watched by the event loop) and the on_dead callback gets the reason once.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.engine.core_process import run_engine_core
from nanoserve.engine.messages import (AbortRequests, AddRequests, CoreFailed, CoreOutput, EngineDead, EngineRequest,
                                       EngineStats, Handshake, SeqOutput, Shutdown)

logger = logging.getLogger("nanoserve")

DEATH_GRACE_S = 0.1  # after the process exits, a moment for its last message (EngineDead: the reason) to arrive
MAX_DRAIN_S = 0.02  # the longest the output reader runs without letting the HTTP handlers write


class EngineStartError(ValueError):
    """The engine core could not start; the message says why in one line."""


class CoreUnreachableError(RuntimeError):
    """The engine core process cannot be sent to (not started, shutting down, or gone)."""


class CoreClient(Protocol):
    """What the front end needs of an engine core, wherever it runs."""

    config: EngineConfig  # resolved (max_model_len, device, ...), as the core runs it
    vocab_size: int

    @property
    def stats(self) -> EngineStats: ...

    def add_requests(self, requests: list[EngineRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...


class InprocClient:
    """The core in this process: calls go straight to EngineCore. Requests the core refuses raise here."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.config, self.vocab_size = core.config, core.vocab_size

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """All or none: a refusal (ValueError) aborts those of the list already added."""
        added = []
        try:
            for r in requests:
                self.core.add_request(r)
                added.append(r.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def step(self) -> list[SeqOutput]:
        return self.core.step()

    def close(self) -> None:
        self.core.close()


class MPClient:
    """The core in a process of its own, over ZeroMQ (msgpack-encoded engine/messages.py structs)."""

    def __init__(self, config: EngineConfig, log_level: str = "info", hf_config=None):
        """Start the engine core process and wait until it is ready (model loaded, graphs captured).
        hf_config: the model's config, checked already (engine/preflight.py), so the core need not read it."""
        started = time.monotonic()
        self._dir = tempfile.mkdtemp(prefix="nanoserve-")
        self._addresses = (f"ipc://{self._dir}/input", f"ipc://{self._dir}/output")
        spawn = multiprocessing.get_context("spawn")
        receiver, sender = spawn.Pipe(duplex=False)
        # not daemonic: a daemonic process may not start the tensor-parallel worker ranks; the core leaves when its
        # parent is gone (core_process.py), and the finalizer below stops it with the client
        self.process = spawn.Process(target=run_engine_core, args=(config, *self._addresses, sender, log_level,
                                                                   hf_config),
                                     name="nanoserve-engine-core", daemon=False)
        self._finalizer = weakref.finalize(self, _stop_process, self.process, self._dir)
        try:
            self.process.start()
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
        self.connected = False
        self.reader: asyncio.Task | None = None
        self._closing = False
        self._encoder = msgspec.msgpack.Encoder()
        logger.info("engine core ready in %.1f s (pid %d)", time.monotonic() - started, self.process.pid)

    def _handshake(self, receiver) -> Handshake:
        while not receiver.poll(0.2):
            if not self.process.is_alive() and not receiver.poll(0):
                raise EngineStartError(f"the engine core process exited while starting ({exit_text(self.process)})")
        try:
            message = msgspec.msgpack.decode(receiver.recv_bytes(), type=Handshake)
        except EOFError:
            self.process.join(5)
            raise EngineStartError(f"the engine core process exited while starting ({exit_text(self.process)})") \
                from None
        if isinstance(message, CoreFailed):
            self.process.join(5)
            raise EngineStartError(message.error)
        return message

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self, on_outputs: Callable[[list[SeqOutput]], None], on_dead: Callable[[str], None]) -> None:
        """Connect (on the event loop that will serve) and read: on_outputs(each step's deltas); on_dead(reason) once
        when the core dies, fails, or cannot be read."""
        loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._context = zmq.asyncio.Context()
        self._input = zmq.Context.shadow(self._context).socket(zmq.PUSH)  # sync: sends never block
        self._output = self._context.socket(zmq.PULL)
        for sock, option in ((self._input, zmq.SNDHWM), (self._output, zmq.RCVHWM)):
            sock.setsockopt(option, 0)  # unbounded: the peer drains it every step
            sock.setsockopt(zmq.LINGER, 0)
        self._input.connect(self._addresses[0])
        self._output.connect(self._addresses[1])
        loop.add_reader(self.process.sentinel, self._on_process_exit)
        self.reader = asyncio.create_task(self._read_outputs(on_outputs), name="nanoserve-engine-outputs")
        self.connected = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core in order (Shutdown, then kill if it does not leave) and stop reading."""
        self._closing = True
        if self.connected and self.process.is_alive():
            try:
                self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.process.join, timeout)
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
        if self.connected:
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
            self._input.close()
            self._output.close()
            self._context.term()
        self.connected = False
        self._finalizer()

    # -- requests -----------------------------------------------------------------------------------
    def add_requests(self, requests: list[EngineRequest]) -> None:
        """Refusals come back as "error" outputs. CoreUnreachableError if nothing can be sent."""
        self._send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(request_ids))

    def _send(self, message) -> None:
        if not self.connected:
            raise CoreUnreachableError("the engine core is not connected")
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise CoreUnreachableError(f"the engine core cannot be reached: {e}") from None

    # -- the reader task ----------------------------------------------------------------------------
    async def _read_outputs(self, on_outputs: Callable[[list[SeqOutput]], None]) -> None:
        """A message already queued is returned without yielding: a reader that fell behind drains the queue
        (handing it on) before the handlers write again; after MAX_DRAIN_S of that it lets them write what has
        arrived so far."""
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
                    self._on_dead(message.reason)
                    return
                self.stats = message.stats
                if message.outputs:
                    on_outputs(message.outputs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reading the engine core's outputs failed")
            self._on_dead(f"reading the engine core's outputs failed: {type(e).__name__}: {e}")

    def _on_process_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.process.sentinel)
        if not self._closing:
            loop.call_later(DEATH_GRACE_S, self._core_exited)

    def _core_exited(self) -> None:
        self.process.join(1.0)  # its pipes close a moment before it can be reaped
        self._on_dead(f"the engine core process died unexpectedly ({exit_text(self.process)})")


def exit_text(process) -> str:
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


__all__ = ["CoreClient", "InprocClient", "MPClient", "EngineStartError", "CoreUnreachableError", "exit_text"]
