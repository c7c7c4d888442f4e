"""The engine core in a process of its own: a busy loop around EngineCore, fed and read over ZeroMQ.

The API process (server/client.py) sends EngineRequests and aborts; this process steps the core while
it has work and sends back each step's SeqOutputs with the core's stats, only what the step added.
When idle it blocks on its input socket, so an idle server burns no CPU. Every message is a msgspec
struct of engine/messages.py encoded as msgpack.

Start-up: the process binds its two sockets, builds the EngineCore and answers over a pipe with either
CoreReady (the resolved config and limits the API needs) or CoreFailed (one line: why), then exits
non-zero. A step that raises is fatal, as in vLLM: the device state is unknown afterwards, so the
process sends EngineDead with the reason and exits; the API fails every request and exits too.
SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group, and the API shuts the core
down in order); the process also leaves when its parent is gone. On a CPU device the core leaves one CPU
core to the API process (torch's intra-op threads would otherwise take them all and stall the event loop).
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys

import msgspec
import torch
import zmq

from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.engine.messages import (AbortRequests, AddRequests, CoreFailed, CoreInput, CoreOutput, CoreReady,
                                       EngineDead, EngineRequest, EngineStats, SeqOutput, StepOutputs)

logger = logging.getLogger("nanoserve")

PARENT_CHECK_MS = 1000  # how often a blocked socket call looks whether the API process still exists


def one_line(e: BaseException) -> str:
    """An exception as one line; ValueErrors (bad model, bad option) carry their own wording."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(e, ValueError) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class CoreLoop:
    """Receive → step → send, until Shutdown. Requests the core refuses come back as "error" outputs."""

    def __init__(self, core, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int | None = None):
        self.core, self.input, self.output = core, input_socket, output_socket
        self.parent_pid = parent_pid
        self._decoder = msgspec.msgpack.Decoder(CoreInput)
        self._encoder = msgspec.msgpack.Encoder()
        self._refused: list[SeqOutput] = []
        self._sent_stats: EngineStats | None = None

    def run(self) -> None:
        """Serve until Shutdown. An exception is fatal: EngineDead (with the reason) goes out, then it propagates."""
        try:
            self._serve()
        except Exception as e:
            logger.exception("the engine core failed; it exits")
            self.send(EngineDead(f"the engine core failed: {one_line(e)}"))
            raise

    def _serve(self) -> None:
        while True:
            if not self.core.has_unfinished_requests():
                self._wait_for_input()
            if not self._handle_inputs():
                return
            outputs, self._refused = self._refused, []
            if self.core.has_unfinished_requests():
                outputs += self.core.step()
            stats = self.core.stats
            if outputs or stats != self._sent_stats:
                self.send(StepOutputs(outputs, stats))
                self._sent_stats = stats

    def send(self, message: CoreOutput) -> None:
        """Blocks only while the API process is not reading (it never is for long); gives up if it died."""
        data = self._encoder.encode(message)
        while True:
            try:
                self.output.send(data, copy=False)
                return
            except zmq.Again:
                self._check_parent()

    def _wait_for_input(self) -> None:
        while not self.input.poll(PARENT_CHECK_MS):
            self._check_parent()

    def _handle_inputs(self) -> bool:
        """Apply every message waiting, in order; False once told to shut down."""
        self._check_parent()
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, AddRequests):
                for request in message.requests:
                    self._add(request)
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            else:
                return False

    def _add(self, request: EngineRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:
            self._refused.append(SeqOutput(request.request_id, [], finish_reason="error", error=str(e)))

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.warning("the API process is gone; the engine core exits")
            raise SystemExit(1)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, handshake,
                    log_level: str = "info", hf_config=None) -> None:
    """The core process's entry point (multiprocessing spawn target). `handshake` is the write end of a Pipe."""
    # a Ctrl-C or a service manager signals the whole process group: the API process drains and then stops the
    # core in order (Shutdown); the core leaves by itself when the API process is gone
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent_pid = os.getppid()
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.setsockopt(zmq.LINGER, 0)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 2000)  # a last EngineDead still reaches the API
    output_socket.setsockopt(zmq.SNDTIMEO, PARENT_CHECK_MS)
    input_socket.setsockopt(zmq.RCVHWM, 0)  # unbounded both ways: neither side ever waits for the other
    output_socket.setsockopt(zmq.SNDHWM, 0)
    input_socket.bind(input_address)
    output_socket.bind(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        core = EngineCore(config, hf_config)
        if core.config.torch_device.type == "cpu":  # leave a core to the API process, which must stay responsive
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    except Exception as e:
        if not isinstance(e, ValueError):  # not a bad model or option: the traceback helps
            logger.exception("the engine core failed to start")
        handshake.send_bytes(encoder.encode(CoreFailed(one_line(e))))
        sys.exit(1)
    handshake.send_bytes(encoder.encode(CoreReady(core.config, core.vocab_size, core.stats)))
    handshake.close()
    freeze_heap()
    try:
        CoreLoop(core, input_socket, output_socket, parent_pid).run()
    except Exception:
        sys.exit(1)
    finally:
        context.destroy()


def freeze_heap() -> None:
    """Move everything start-up allocated (modules, the model, graphs, compiled kernels) out of the garbage
    collector's reach: a full collection then scans only what serving allocates, instead of pausing a step for
    the whole heap (as vLLM does after start-up). At exit the heap is handed back: frozen cycles are never
    collected, and the extensions whose objects they hold (triton's nanobind bindings) would report them as
    leaked, dozens of `nanobind: leaked ...` lines on every stop."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


__all__ = ["CoreLoop", "run_engine_core", "freeze_heap"]
