"""The asynchronous loop's state in one object: the steps launched whose tokens the host has not read, and at most
one step whose forward runs with its sampler deferred (structured outputs: its grammar masks are filled meanwhile).

The rules that keep the loop correct (engine/core.py's docstring tells why) are checked here as they happen:
  * steps are read in launch order, each once;
  * a deferred step is the newest launched: no other step launches until its sampler has;
  * its sampler launches only once every earlier step has been read (their tokens advance the matchers whose masks
    it samples under), and before any later forward (which reads the tokens it samples);
  * with overlap at most two steps are in flight at once (the one running and the one just launched).
HostClock times the host's own share of a step, what the device waits for whenever the loop does not overlap.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

from nanoserve.engine.scheduler import ScheduledStep
from nanoserve.engine.sequence import Sequence
from nanoserve.runner.batch import SamplingBatch

MAX_IN_FLIGHT = 2


@dataclass
class InFlight:
    """A launched step: its schedule, its sampled sequences in row order, and its SampleHandle (None until its
    sampler launched, or when it samples nothing)."""

    step: ScheduledStep
    sampled: list[Sequence]
    handle: object | None = None


@dataclass
class Deferred:
    """A step whose forward runs without its sampler: the runner's PendingSample and the sampling batch it waits
    to complete with the masks."""

    launched: InFlight
    sampling: SamplingBatch
    pending: object


class StepPipeline:
    def __init__(self):
        self._inflight: deque[InFlight] = deque()
        self.deferred: Deferred | None = None

    def __len__(self) -> int:
        """Steps in flight (launched whole, or with their sampler launched)."""
        return len(self._inflight)

    @property
    def busy(self) -> bool:
        return bool(self._inflight) or self.deferred is not None

    @property
    def verifying(self) -> bool:
        """A step in flight verifies drafts (its sequences' lengths are known only once it is read)."""
        return any(any(entry.step.drafts) for entry in self._inflight)

    def launched(self, entry: InFlight) -> None:
        """A step launched whole."""
        assert self.deferred is None, "a step launched while a deferred step's sampler waits (it reads its tokens)"
        assert len(self._inflight) < MAX_IN_FLIGHT, "more than two steps in flight"
        self._inflight.append(entry)

    def defer(self, entry: InFlight, sampling: SamplingBatch, pending) -> None:
        """A step launched without its sampler."""
        assert self.deferred is None, "two deferred steps at once"
        assert entry.handle is None
        self.deferred = Deferred(entry, sampling, pending)

    def oldest(self) -> InFlight:
        """The next step to read (launch order), taken out of flight."""
        return self._inflight.popleft()

    def take_all(self) -> list[InFlight]:
        """Every step in flight, oldest first."""
        taken = list(self._inflight)
        self._inflight.clear()
        return taken

    def take_deferred(self) -> Deferred:
        """The deferred step, for its sampler to launch now: every earlier step has been read."""
        assert self.deferred is not None, "no deferred step"
        assert not self._inflight, "a deferred step's sampler launched before the steps before it were read"
        deferred, self.deferred = self.deferred, None
        return deferred

    def sampler_launched(self, deferred: Deferred, handle) -> None:
        """The deferred step's sampler launched: the step is in flight like any other."""
        deferred.launched.handle = handle
        self._inflight.append(deferred.launched)

    def clear(self) -> None:
        """Forget everything in flight (a dead tensor-parallel worker took it with it)."""
        self._inflight.clear()
        self.deferred = None




class HostClock:
    """The host's own time a step (step() minus its waits for sampled tokens), as an exponential average: what the
    device idles for when the loop waits for the host (engine/speculation.Speculator.worth_waiting); and both shares
    summed over the steps (/metrics, benchmarks: a loop whose own time a step nears the step's wall time keeps the
    device waiting)."""

    WEIGHT = 0.2  # each step's share of the average

    def __init__(self):
        self.ms: float | None = None
        self.busy_s = self.wait_s = 0.0  # totals over the steps launched
        self._began = self._waited = 0.0

    def begin(self) -> None:
        self._began, self._waited = time.perf_counter(), 0.0

    @contextmanager
    def waiting(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._waited += time.perf_counter() - start

    def totals(self) -> dict[str, float]:
        """The EngineStats fields of the loop's time."""
        return {"host_busy_seconds": self.busy_s, "host_wait_seconds": self.wait_s}

    def end(self) -> None:
        busy = time.perf_counter() - self._began - self._waited
        self.busy_s += busy
        self.wait_s += self._waited
        ms = busy * 1e3
        self.ms = ms if self.ms is None else (1 - self.WEIGHT) * self.ms + self.WEIGHT * ms


__all__ = ["StepPipeline", "InFlight", "Deferred", "HostClock"]
