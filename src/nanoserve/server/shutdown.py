"""DrainingServer: uvicorn's server with the drain `nanoserve serve` promises on SIGTERM or SIGINT (Ctrl-C).

The first signal stops accepting connections and lets the requests in flight finish, for up to
--shutdown-timeout seconds. At that deadline, or at once on a second signal, every request still open is
ended by the engine client: a stream with an error event and [DONE], a non-streamed request with a 503;
a connection still open a moment later (a client still sending its body) is closed. Then the engine core
is stopped in order (the app's lifespan) and `serve()` returns 0: the signal is handled, not re-raised as
uvicorn does, because process managers read a death by signal as a crash. uvicorn's own graceful timeout,
which cancels handlers mid-stream with a traceback, is left past the deadline as a last resort only.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time

import uvicorn

logger = logging.getLogger("nanoserve.server")

CUT_GRACE_S = 1.0  # after ending the requests: how long their handlers have to write their last event
BACKSTOP_S = 5.0  # past the deadline: when uvicorn may cancel what is left (never in an orderly shutdown)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_client, shutdown_timeout: float):
        config.timeout_graceful_shutdown = shutdown_timeout + CUT_GRACE_S + BACKSTOP_S
        super().__init__(config)
        self.engine_client, self.shutdown_timeout = engine_client, shutdown_timeout
        self._signals = 0

    def handle_exit(self, sig: int, frame) -> None:
        """First signal: drain. Second: end the requests in flight now. Third: uvicorn's force exit."""
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: draining (requests in flight have up to %g s; a second signal ends them now)",
                        signal.Signals(sig).name, self.shutdown_timeout)
        elif self._signals > 2:
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """As uvicorn's, without re-raising the signal after the shutdown: an orderly shutdown exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self._end_at_deadline(), name="nanoserve-drain")
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _end_at_deadline(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline and self._signals < 2:
            await asyncio.sleep(0.05)
        why = "a second signal" if self._signals >= 2 else f"its drain deadline of {self.shutdown_timeout:g} s passed"
        ended = self.engine_client.end_requests(f"The server is shutting down ({why}); the request was ended.")
        if ended:
            logger.warning("shutting down: ended %d request(s) still in flight (%s)", ended, why)
        await asyncio.sleep(CUT_GRACE_S)
        for connection in list(self.server_state.connections):  # e.g. a client still sending its body
            transport = getattr(connection, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.close()
