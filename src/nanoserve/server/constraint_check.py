"""A request's output constraint (JSON schema, regex, grammar) checked before it reaches the engine core, without
letting one client's schema stall anyone else.

xgrammar builds a grammar without a way to stop it, and some inputs take it tens of seconds (a JSON-schema pattern
such as ^(ab|cd){1,5000}$). So the checks run on a pool of their own (CONSTRAINT_CHECK_THREADS; the default pool, which
stop strings and other off-loop work use, stays free), and a request waits at most CONSTRAINT_CHECK_TIMEOUT_S for its
check, queueing included: then it is answered 400. The check itself runs on; the same constraint sent again meanwhile
waits on that one run instead of taking another thread, and one that ran over the budget is remembered (its key's
hash, the last CONSTRAINT_CHECK_SLOW_KEPT) and refused at once.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from nanoserve.config import CONSTRAINT_CHECK_SLOW_KEPT, CONSTRAINT_CHECK_THREADS, CONSTRAINT_CHECK_TIMEOUT_S
from nanoserve.engine import grammar
from nanoserve.errors import RequestError
from nanoserve.sampling import StructuredOutputsParams


class ConstraintChecker:
    def __init__(self, timeout_s: float = CONSTRAINT_CHECK_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(CONSTRAINT_CHECK_THREADS, thread_name_prefix="nanoserve-constraint")
        self._lock = threading.Lock()  # the maps below are touched by the event loop and by finished checks
        self._running: dict[int, Future] = {}
        self._slow: OrderedDict[int, None] = OrderedDict()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def check(self, so: StructuredOutputsParams, where: str | None) -> None:
        """grammar.check's RequestError for a bad constraint; one too that says so when the budget ran out."""
        key = hash(so.key)
        with self._lock:
            future = None if key in self._slow else self._running.get(key)
            if future is None and key not in self._slow:
                future = self._running[key] = self._executor.submit(self._timed_check, key, so, where)
        if future is not None:
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
            except asyncio.TimeoutError:
                pass
        raise RequestError(f"{where or 'structured_outputs.' + so.key[0]}: the constraint took longer than "
                           f"{self.timeout_s:g} s to check; simplify it (shorter bounded repeats, fewer alternatives)",
                           param="structured_outputs")

    def _timed_check(self, key: int, so: StructuredOutputsParams, where: str | None) -> None:
        """On the pool: the check (its error said of the first request's field), then the bookkeeping."""
        start = time.monotonic()
        try:
            grammar.check(so, where)
        finally:
            with self._lock:
                self._running.pop(key, None)
                if time.monotonic() - start > self.timeout_s:
                    self._slow[key] = None
                    while len(self._slow) > CONSTRAINT_CHECK_SLOW_KEPT:
                        self._slow.popitem(last=False)


__all__ = ["ConstraintChecker"]
