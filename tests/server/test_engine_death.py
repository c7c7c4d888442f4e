"""The engine core process dying: requests in flight fail within a second or two with a clear error (a 5xx
JSON answer, or an SSE error event), and `nanoserve serve` exits non-zero; nothing hangs. A core that cannot
start is one line on stderr and a non-zero exit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx

MODEL = "tiny"
FAIL_WITHIN_S = 2.0


def test_killed_core_fails_requests_fast_and_the_server_exits(model_dir, serve_process):
    server = serve_process(model_dir, "--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "4",
                           "--num-kv-blocks", "64", "--served-model-name", MODEL)
    core = server.core_pid
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
    got: dict[str, tuple[float, object]] = {}

    def plain():
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        got["plain"] = (time.monotonic(), (r.status_code, r.json()))

    def streamed():
        events = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if '"error"' in line:
                        got["error_event"] = (time.monotonic(), json.loads(line[6:]))
        got["stream"] = (time.monotonic(), events)

    os.kill(core, signal.SIGSTOP)  # both requests are surely in flight when the core goes
    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    killed = time.monotonic()
    os.kill(core, signal.SIGKILL)
    for t in threads:
        t.join(30)

    done, (status, answer) = got["plain"]
    assert status == 500 and answer["error"]["code"] == "engine_dead", answer
    assert "died unexpectedly (killed by signal 9)" in answer["error"]["message"]
    assert done - killed < FAIL_WITHIN_S
    when, event = got["error_event"]
    assert event["error"]["code"] == "engine_dead" and when - killed < FAIL_WITHIN_S
    assert got["stream"][1][-1] == "[DONE]"
    assert server.proc.wait(15) == 1, server.log()
    assert "exiting: the engine core is gone" in server.log()


def test_a_core_that_cannot_start_is_one_line_and_nonzero(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # only the core reads the weights
    cmd = [sys.executable, "-m", "nanoserve", "serve", "--model", str(broken), "--device", "cpu", "--port", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("nanoserve: error: ") and "model.safetensors" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
