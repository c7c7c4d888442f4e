"""The asynchronous loop's state (engine/pipeline.py): its rules hold as steps launch, defer and are read, and a
step that would break one is refused on the spot."""
from __future__ import annotations

import pytest

import time

from nanoserve.engine.pipeline import HostClock, InFlight, StepPipeline
from nanoserve.engine.scheduler import ScheduledStep


def _step(handle=None) -> InFlight:
    return InFlight(ScheduledStep(), [], handle)


def test_steps_are_read_in_launch_order_and_at_most_two_fly():
    p = StepPipeline()
    first, second = _step("h1"), _step("h2")
    p.launched(first)
    p.launched(second)
    with pytest.raises(AssertionError, match="more than two"):
        p.launched(_step("h3"))
    assert len(p) == 2 and p.busy and p.oldest() is first and p.take_all() == [second] and not p.busy


def test_a_deferred_step_is_the_newest_and_its_sampler_waits_for_the_steps_before_it():
    p = StepPipeline()
    earlier, deferred = _step("h1"), _step()
    p.launched(earlier)
    p.defer(deferred, sampling="sampling", pending="pending")
    with pytest.raises(AssertionError, match="deferred step's sampler waits"):
        p.launched(_step("h2"))  # a later forward would read the tokens the deferred sampler has not drawn
    with pytest.raises(AssertionError, match="two deferred"):
        p.defer(_step(), sampling="s", pending="p")
    with pytest.raises(AssertionError, match="before the steps before it were read"):
        p.take_deferred()
    assert p.take_all() == [earlier]
    taken = p.take_deferred()
    assert (taken.launched, taken.sampling, taken.pending) == (deferred, "sampling", "pending") and p.deferred is None
    p.sampler_launched(taken, "h-deferred")
    assert p.oldest() is deferred and deferred.handle == "h-deferred"
    p.launched(_step("h3"))  # the sampler launched: later steps may follow
    p.clear()
    assert not p.busy


def test_the_host_clock_sums_a_steps_own_time_apart_from_its_waits():
    """busy + wait is each step's wall time; only busy feeds the average the back-off prices."""
    clock, wall = HostClock(), 0.0
    for _ in range(3):
        start = time.perf_counter()
        clock.begin()
        time.sleep(0.002)
        with clock.waiting():
            time.sleep(0.004)
        clock.end()
        wall += time.perf_counter() - start
    assert clock.busy_s + clock.wait_s <= wall
    assert 3 * 0.002 <= clock.busy_s < clock.wait_s
    assert 3 * 0.004 <= clock.wait_s
    assert 2 <= clock.ms < 1e3 * clock.busy_s
