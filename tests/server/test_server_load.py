"""Concurrency and lifecycle: 64 concurrent streaming clients all get the right text and leave the KV
cache empty; a client that disconnects (streaming or not) has its request aborted in the core and its
blocks freed; /metrics counts what happened; the idle core process burns no CPU. Where a test needs the
engine to hold still, the core process is frozen (SIGSTOP) rather than slowed by a patch."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.server import build_app

MODEL = "tiny"  # served_model_name of the `live` server (tests/server/conftest.py)
NUM_CLIENTS = 64


def test_64_concurrent_streaming_clients(live, offline):
    prompts = [f"Request number {i}: the quick brown fox" for i in range(NUM_CLIENTS)]
    expected = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0),
                                                 use_tqdm=False)]
    before = live.metrics()

    async def one(client, prompt: str) -> tuple[str, str | None, int]:
        text, finish, usage = "", None, None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage.completion_tokens

    async def main():
        async with live.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert [r[0] for r in results] == expected
    assert all(r[1] in ("stop", "length") for r in results)
    live.wait_idle()  # every request finished and its KV blocks are free again
    assert live.engine_client.stats.kv_blocks_used == 0
    after = live.metrics()
    assert live.metric(after, "nanoserve_http_requests_total", status="200") - \
        live.metric(before, "nanoserve_http_requests_total", status="200") == NUM_CLIENTS
    generated = sum(r[2] for r in results)
    assert live.metric(after, "nanoserve_generation_tokens_total") - \
        live.metric(before, "nanoserve_generation_tokens_total") == generated
    steps = sum(live.metric(after, "nanoserve_decode_steps_total", mode=m) -
                live.metric(before, "nanoserve_decode_steps_total", mode=m) for m in ("graph", "eager"))
    assert steps < generated / 4, "the 64 requests should have been decoded in shared batches"


def _aborted(live) -> float:
    return live.metric(live.metrics(), "nanoserve_completions_finished_total", reason="abort")


def _generated(live) -> float:
    return live.metric(live.metrics(), "nanoserve_generation_tokens_total")


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


LONG = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True}


def test_streaming_client_disconnect_aborts_and_frees_blocks(live):
    aborted, generated = _aborted(live), _generated(live)
    with live.http() as http, http.stream("POST", "/v1/completions", json={**LONG, "stream": True, "n": 2}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events in, then freeze the engine and hang up
        assert any(line.startswith("data: {") for line in got)
        with live.core_frozen():
            assert live.engine_client.stats.kv_blocks_used > 0
            r.close()
            _wait_for(lambda: _aborted(live) - aborted == 2, "the disconnect was not noticed")  # both completions
    live.wait_idle(timeout=5)
    assert _generated(live) - generated < 2 * 200, "the aborted completions must not run to max_tokens"


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(live):
    aborted, generated = _aborted(live), _generated(live)
    with live.core_frozen():  # the request waits in the core's input; the client gives up first
        with live.http() as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", timeout=0.5,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                            "ignore_eos": True})
        _wait_for(lambda: _aborted(live) - aborted == 1, "the disconnect was not noticed")
    live.wait_idle(timeout=5)
    assert _generated(live) - generated < 200, "the request must have been aborted when the client left"


def test_disconnect_before_first_token(live):
    """A streaming client can leave before anything was produced (nothing is being sent then); the server
    must still notice and abort the request."""
    aborted, generated = _aborted(live), _generated(live)
    with live.core_frozen():
        with live.http() as http, http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200  # headers arrive before the first token
            assert live.engine_client.has_unfinished_requests()
        _wait_for(lambda: _aborted(live) > aborted, "the disconnect was not noticed")  # while the core is frozen
    live.wait_idle(timeout=10)
    assert _generated(live) - generated < 200, "the aborted request must not run to max_tokens"
    assert _aborted(live) - aborted == 1


def test_metrics_count_what_happened(live):
    live.wait_idle()
    before = live.metrics()
    client = live.client()
    usages = [client.completions.create(model=MODEL, prompt=f"Counting request {i}", max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage for i in range(3)]
    with live.http() as http:
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 5}).status_code == 400
    after = live.metrics()

    def delta(name, **labels):
        return live.metric(after, name, **labels) - live.metric(before, name, **labels)

    assert delta("nanoserve_http_requests_total", status="200") == 3
    assert delta("nanoserve_http_requests_total", status="400") == 1
    assert delta("nanoserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("nanoserve_generation_tokens_total") == 12
    assert delta("nanoserve_completions_finished_total", reason="length") == 3
    assert delta("nanoserve_time_to_first_token_seconds_count") == 3
    assert delta("nanoserve_inter_token_latency_seconds_count") == 9  # 3 gaps in each 4-token answer
    assert delta("nanoserve_request_latency_seconds_count") == 3
    assert delta("nanoserve_decode_steps_total", mode="graph") + delta("nanoserve_decode_steps_total",
                                                                       mode="eager") == 9
    assert delta("nanoserve_padding_rows_total") == 0  # CPU: no graphs, no padding
    assert delta("nanoserve_engine_loop_seconds_total", part="busy") > 0  # the loop's own work in those steps
    assert delta("nanoserve_engine_loop_seconds_total", part="wait") >= 0
    for gauge in ("nanoserve_num_requests_running", "nanoserve_num_requests_waiting", "nanoserve_kv_cache_usage",
                  "nanoserve_kv_cache_blocks_used"):
        assert live.metric(after, gauge) == 0, gauge
    assert live.metric(after, "nanoserve_kv_cache_blocks_total") == live.engine_client.stats.kv_blocks_total


def test_kv_usage_gauge_while_running(live):
    with live.http() as http, http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()  # keep it referenced: a dropped iterator closes the connection
        next(lines)
        with live.core_frozen():  # the stats of the core's last message show the running request
            m = live.metrics()
            assert live.metric(m, "nanoserve_num_requests_running") == 1
            assert 0 < live.metric(m, "nanoserve_kv_cache_usage") < 1
    live.wait_idle(timeout=5)


def test_idle_core_process_sleeps(live):
    """Idle, the core blocks on its input socket: it neither steps nor polls (no CPU time), and wakes at once."""
    live.wait_idle()
    time.sleep(0.2)
    before = live.core_cpu_seconds()
    time.sleep(1.0)
    assert live.core_cpu_seconds() - before <= 0.02
    r = live.client().completions.create(model=MODEL, prompt="wake up", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


@pytest.mark.gpu
def test_gpu_server_decodes_by_graph_replay(model_dir, serve_app):
    """On a GPU the server's decode steps replay CUDA graphs; /metrics shows it (and the padded rows)."""
    app = build_app(model_dir, device="cuda", max_num_seqs=8, max_model_len=256, show_progress=False,
                    cudagraph_capture_sizes="pow2", num_kv_blocks=256,  # by blocks: free memory depends on other tests
                    served_model_name=MODEL)
    server = serve_app(app)

    async def one(client, i):
        r = await client.completions.create(model=MODEL, prompt=f"GPU request {i}", max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(5)))

    assert asyncio.run(main()) == [16] * 5
    server.wait_idle()
    m = server.metrics()
    assert server.metric(m, "nanoserve_decode_steps_total", mode="graph") > 0
    assert server.metric(m, "nanoserve_decode_steps_total", mode="eager") == 0
    assert server.metric(m, "nanoserve_padding_rows_total") > 0  # 5 or 3 live rows run in the 8-row graph
    assert server.metric(m, "nanoserve_kv_cache_usage") == 0


def test_a_blocked_event_loop_never_stalls_the_engine(live):
    """The API's event loop held for 0.5 s mid-stream: the core keeps decoding (its CPU time grows meanwhile),
    and what it produced reaches the client merged into bigger chunks, every token once."""
    body = {**LONG, "max_tokens": 150, "stream": True, "return_token_ids": True}
    loop = live.engine_client.core_client.reader.get_loop()
    chunks: list[tuple[float, int]] = []
    with live.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append((time.monotonic(), len(json.loads(line[6:])["choices"][0]["token_ids"])))
            if len(chunks) == 3:
                cpu = live.core_cpu_seconds()
                loop.call_soon_threadsafe(time.sleep, 0.5)  # blocks the server's event loop, not the core
                time.sleep(0.5)
                core_cpu_while_blocked = live.core_cpu_seconds() - cpu
    assert sum(n for _, n in chunks) == 150
    assert core_cpu_while_blocked > 0.05, "the core must keep stepping while the API's loop is blocked"
    assert max(n for _, n in chunks[3:]) > 1, "tokens produced meanwhile must arrive merged, not queued one by one"
