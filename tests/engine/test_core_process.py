"""The engine core's loop (engine/core_process.py) driven over real ZeroMQ sockets, in a thread: requests in,
per-step deltas out (greedy tokens == the offline engine's), refusals as "error" outputs, aborts free blocks
(and the idle core still reports the new stats), a failing step is fatal and says why, Shutdown ends it."""
from __future__ import annotations

import threading

import msgspec
import pytest

zmq = pytest.importorskip("zmq")  # the server's dependency (the GPU image may lack it)

from nanoserve import LLM, EngineConfig, SamplingParams  # noqa: E402
from nanoserve.engine.core import EngineCore  # noqa: E402
from nanoserve.engine.core_process import CoreLoop  # noqa: E402
from nanoserve.engine.messages import (AbortRequests, AddRequests, CoreOutput, EngineDead, EngineRequest,  # noqa: E402
                                       Shutdown, StepOutputs)

OPTIONS = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=64, show_progress=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Harness:
    """A CoreLoop on a thread; this side holds the other ends of its two sockets."""

    def __init__(self, core, tmp_path):
        self.core = core
        self.context = zmq.Context()
        addresses = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        core_in, core_out = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
        core_in.bind(addresses[0])
        core_out.bind(addresses[1])
        self.send_socket, self.recv_socket = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
        self.send_socket.connect(addresses[0])
        self.recv_socket.connect(addresses[1])
        self.recv_socket.setsockopt(zmq.RCVTIMEO, 30_000)
        self.loop = CoreLoop(core, core_in, core_out)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.decoder = msgspec.msgpack.Decoder(CoreOutput)

    def _run(self):
        try:
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def send(self, message):
        self.send_socket.send(msgspec.msgpack.encode(message))

    def recv(self):
        return self.decoder.decode(self.recv_socket.recv())

    def collect(self, until_finished: set[str]) -> tuple[dict[str, list], list[StepOutputs]]:
        tokens: dict[str, list] = {}
        messages = []
        while until_finished:
            message = self.recv()
            assert isinstance(message, StepOutputs), message
            messages.append(message)
            for out in message.outputs:
                tokens.setdefault(out.request_id, []).append(out)
                if out.finish_reason is not None:
                    until_finished.discard(out.request_id)
        return tokens, messages

    def close(self):
        if self.thread.is_alive():
            self.send(Shutdown())
            self.thread.join(30)
        self.context.destroy(linger=0)


@pytest.fixture
def harness(tiny_model_dirs, tmp_path):
    h = Harness(EngineCore(EngineConfig.from_kwargs(str(tiny_model_dirs["qwen3"]), **OPTIONS)), tmp_path)
    yield h
    h.close()


def test_deltas_match_the_offline_engine_and_refusals_are_outputs(harness, tiny_model_dirs):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    expected = [o.token_ids for o in LLM(str(tiny_model_dirs["qwen3"]), **OPTIONS).generate(prompts, GREEDY,
                                                                                          use_tqdm=False)]
    harness.send(AddRequests([EngineRequest("a", prompts[0], GREEDY), EngineRequest("b", prompts[1], GREEDY),
                              EngineRequest("bad", [1] * 100, GREEDY)]))
    outputs, messages = harness.collect({"a", "b", "bad"})
    assert [t for o in outputs["a"] for t in o.new_token_ids] == expected[0]
    assert [t for o in outputs["b"] for t in o.new_token_ids] == expected[1]
    assert all(len(o.new_token_ids) == 1 for o in outputs["a"]), "one delta per step, never cumulative"
    (refused,) = outputs["bad"]
    assert refused.finish_reason == "error" and "max_model_len" in refused.error
    assert messages[-1].stats.kv_blocks_used == 0 and messages[-1].stats.num_running == 0


def test_abort_frees_blocks_and_the_idle_core_reports_it(harness):
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    harness.send(AddRequests([EngineRequest("a", [5, 6, 7], long)]))
    message = harness.recv()
    while not any(o.new_token_ids for o in message.outputs):
        message = harness.recv()
    harness.send(AbortRequests(["a"]))
    while True:  # the abort lands; the stats that follow show the blocks free, and nothing more comes for "a"
        message = harness.recv()
        if message.stats.kv_blocks_used == 0 and message.stats.num_running == 0:
            break
    assert not harness.core.has_unfinished_requests()
    harness.send(Shutdown())
    harness.thread.join(30)
    assert not harness.thread.is_alive() and harness.error is None


def test_a_failing_step_is_fatal_and_says_why(harness, monkeypatch):
    def broken_step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(harness.core, "step", broken_step)
    harness.send(AddRequests([EngineRequest("a", [5, 6, 7], GREEDY)]))
    message = harness.recv()
    assert isinstance(message, EngineDead)
    assert message.reason == ("the engine core failed: RuntimeError: CUDA error: an illegal memory access was "
                              "encountered")
    harness.thread.join(30)
    assert isinstance(harness.error, RuntimeError)


def test_the_loop_leaves_when_its_parent_is_gone(tiny_model_dirs, tmp_path):
    core = EngineCore(EngineConfig.from_kwargs(str(tiny_model_dirs["qwen3"]), **OPTIONS))
    h = Harness(core, tmp_path)
    try:
        h.loop.parent_pid = -1  # not our parent: as if the API process had died
        h.send(AddRequests([EngineRequest("a", [5, 6, 7], GREEDY)]))
        h.thread.join(30)
        assert isinstance(h.error, SystemExit)
    finally:
        h.close()
