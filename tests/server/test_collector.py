"""RequestCollector: the front end's RequestOutputs pass through as they are; deltas put faster than they are taken
merge into one (text, ids, logprobs, finish); nothing is lost or duplicated; errors reach the taker; close() aborts
only what is unfinished."""
from __future__ import annotations

import asyncio

import pytest

from nanoserve.engine.output import CompletionOutput, RequestOutput
from nanoserve.server.collector import EngineDeadError, RequestCollector, RequestRejectedError


def delta(rid, index, text, ids, finish=None, logprobs=None, finished=False, error=None):
    c = CompletionOutput(index, text, ids, finish, None, logprobs)
    return RequestOutput(rid, None, [1, 2, 3], [c], finished, error=error)


def make(num_prompts=1, n=1):
    closed = []
    rids = [f"r-{i}" for i in range(num_prompts)]
    return RequestCollector(rids, [[1, 2, 3]] * num_prompts, n, closed.append), closed


def test_a_slow_taker_gets_one_merged_delta():
    async def run():
        col, _ = make()
        col.put(0, delta("r-0", 0, "He", [5], logprobs=[{5: -0.1}]))
        col.put(0, delta("r-0", 0, "llo", [6, 7], logprobs=[{6: -0.2}, {7: -0.3}]))
        col.put(0, delta("r-0", 0, "!", [8], finish="length", logprobs=[{8: -0.4}], finished=True))
        ((i, out),) = await col.get()
        (c,) = out.outputs
        assert (i, c.text, c.token_ids) == (0, "Hello!", [5, 6, 7, 8])
        assert c.logprobs == [{5: -0.1}, {6: -0.2}, {7: -0.3}, {8: -0.4}]
        assert c.finish_reason == "length" and out.finished and col.finished
        assert col.num_completion_tokens == 4 and col.num_prompt_tokens == 3
    asyncio.run(run())


def test_interleaved_put_and_take_loses_nothing():
    async def run():
        col, _ = make(num_prompts=2, n=2)
        pieces = {(i, j): [] for i in range(2) for j in range(2)}

        async def producer():
            for step in range(50):
                for i in range(2):
                    for j in range(2):
                        last = step == 49
                        col.put(i, RequestOutput(f"r-{i}", None, [1], [CompletionOutput(
                            j, f"<{step}>", [step], "stop" if last else None, None, None)], last and j == 1))
                if step % 7 == 0:
                    await asyncio.sleep(0)

        task = asyncio.create_task(producer())
        while True:
            for i, out in await col.get():
                assert [c.index for c in out.outputs] == sorted(c.index for c in out.outputs)
                for c in out.outputs:
                    pieces[i, c.index].append((c.text, c.token_ids))
            if col.finished:
                break
        await task
        for key, got in pieces.items():
            assert "".join(t for t, _ in got) == "".join(f"<{s}>" for s in range(50)), key
            assert [t for _, ids in got for t in ids] == list(range(50)), key
        assert len(sum(pieces.values(), [])) < 4 * 50, "a taker that is behind must get merged deltas"
    asyncio.run(run())


def test_result_waits_for_every_prompt():
    async def run():
        col, _ = make(num_prompts=2)
        col.put(1, delta("r-1", 0, "b", [2], "stop", finished=True))
        waiter = asyncio.create_task(col.result())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        col.put(0, delta("r-0", 0, "a", [1], "length", finished=True))
        got = await waiter
        assert [(i, out.text) for i, out in got] == [(0, "a"), (1, "b")]
    asyncio.run(run())


def test_errors_reach_the_taker():
    async def run():
        col, _ = make()
        col.put(0, delta("r-0", 0, "x", [1]))
        col.fail(EngineDeadError("the engine core process died"))
        with pytest.raises(EngineDeadError):
            await col.get()
        with pytest.raises(EngineDeadError):
            await col.result()
        refused, _ = make()
        refused.put(0, delta("r-0", 0, "", [], "error", finished=True, error="prompt too long"))
        with pytest.raises(RequestRejectedError, match="prompt too long"):
            await refused.result()
    asyncio.run(run())


def test_close_reports_unfinished_once():
    async def run():
        col, closed = make(num_prompts=2)
        col.put(0, delta("r-0", 0, "a", [1], "stop", finished=True))
        assert not col.finished  # r-1 is still running
        col.close()
        col.close()
        assert closed == [col]
    asyncio.run(run())


def test_an_output_taken_in_time_is_the_front_ends_own_object():
    async def run():
        col, _ = make()
        first = delta("r-0", 0, "a", [1])
        col.put(0, first)
        ((_, out),) = await col.get()
        assert out is first  # passed through, not unpacked and repacked
        last = delta("r-0", 0, "b", [2], "stop", finished=True)
        col.put(0, last)
        ((_, out),) = await col.result()
        assert out is last and out.text == "b"
    asyncio.run(run())
