"""The stall bound: while a 30 MB prompt is being received and rejected, a concurrent stream keeps its
inter-token gaps under 100 ms (tiny model, CPU). The prompt is refused on its length in characters,
before any tokenization; decoding the body is the only work it costs the event loop. The server runs
as `nanoserve serve` in its own process, so the test's clients do not share its interpreter."""
from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

MODEL = "tiny"
MAX_GAP_S = 0.100


@pytest.fixture(scope="module")
def server(model_dir, serve_process):
    server = serve_process(model_dir, "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8",
                           "--num-kv-blocks", "256", "--served-model-name", MODEL)
    yield server
    assert server.stop() == 0, server.log()


def _stream_arrivals(base_url: str, arrivals: list[float], started: threading.Event, stop: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 5:
                    started.set()
            if stop.is_set():
                return


def _post_raw(base_url: str, body: bytes) -> tuple[int, dict]:
    """One POST over a plain socket (sendall releases the GIL: the uploader costs the reader thread nothing)."""
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _trial(server, huge: bytes) -> tuple[float, float, float]:
    """(worst gap while the prompt was rejected, worst gap before it, seconds the rejections took)."""
    arrivals: list[float] = []
    started, stop = threading.Event(), threading.Event()
    reader = threading.Thread(target=_stream_arrivals, args=(server.base_url, arrivals, started, stop))
    reader.start()
    assert started.wait(30), "the stream did not start"
    t0 = time.monotonic()
    for _ in range(2):
        status, answer = _post_raw(server.base_url, huge)
        assert status == 400 and "max_model_len" in answer["error"]["message"], answer
    t1 = time.monotonic()
    time.sleep(0.15)  # an event after the window closes its last gap
    stop.set()
    reader.join(30)
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b < t0]
    window = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1]
    assert window, "the stream must have run during the rejection"
    return max(window), max(before, default=0.0), t1 - t0


def test_huge_prompt_is_refused_without_stalling_a_stream(server):
    """Up to three trials, one of which must keep every gap under the bound: a stall built into the server
    (decoding or tokenizing on the event loop for long) fails them all, a busy shared CI machine only some."""
    huge = json.dumps({"model": MODEL, "prompt": "hello world " * 2_500_000, "max_tokens": 4}).encode()
    assert len(huge) > 30_000_000
    trials = []
    for _ in range(3):
        trials.append(_trial(server, huge))
        if trials[-1][0] < MAX_GAP_S:
            return
    raise AssertionError("every trial had a gap over 100 ms while the 30 MB prompt was rejected: " + "; ".join(
        f"worst {w * 1000:.0f} ms (before: {b * 1000:.0f} ms; rejections took {t:.2f} s)" for w, b, t in trials))
