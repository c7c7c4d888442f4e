"""Where one streamed request's time to first token goes in `nanoserve serve`: a timeline across the client,
the API process and the engine core process, against the offline engine's TTFT for the same prompt length.

The server runs with benchmarks/timeline_probe on its PYTHONPATH, which timestamps the handler, the submission,
the core's input handling, steps and sends, and the API's delivery of outputs (time.perf_counter is one clock
for every process of a machine). Requests go one at a time (1 stream), as serve.py's 1-stream level sends them:
random token ids, 1024 in / 128 out, greedy, ignore_eos, streamed with return_token_ids.

    python benchmarks/serve_timeline.py [--model qwen3-0.6b] [--requests 40] [--out FILE] [--device cpu]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import serve  # noqa: E402

PROBE = Path(__file__).resolve().parent / "timeline_probe"


def stream_one(client, prompt: list[int], output_len: int, marks: list) -> None:
    body = {"model": serve.SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "return_token_ids": True}
    marks.append((time.perf_counter() * 1e3, "client.send"))
    first = True
    with client.stream("POST", "/v1/completions", json=body) as response:
        for chunk in response.iter_raw():
            if first and chunk.startswith(b"data: "):
                marks.append((time.perf_counter() * 1e3, "client.first"))
                first = False
    marks.append((time.perf_counter() * 1e3, "client.done"))


def timelines(directory: Path, marks: list) -> list[list[tuple[float, str]]]:
    """Every process's marks merged in time order, cut into one list per request (client.send → client.first)."""
    events = list(marks)
    for log in directory.glob("*.log"):
        for line in log.read_text().splitlines():
            t, label = line.split(" ", 1)
            events.append((float(t), label))
    events.sort()
    out, current = [], None
    for t, label in events:
        if label == "client.send":
            current = [(t, label)]
        elif current is not None:
            current.append((t, label))
            if label == "client.first":
                out.append([(round(x - current[0][0], 3), lab) for x, lab in current])
                current = None
    return out


def phases(line: list[tuple[float, str]]) -> dict:
    """Milestones of one request: the handler's start, the submission's end, the core's first add, the end of the
    core step whose send carries the first token (the last core.send before api.deliver), delivery, first byte."""
    at = {}
    for t, label in line:
        at.setdefault(label, t)
    last_send = max((t for t, lab in line if lab == "core.send>" and t <= at.get("api.deliver>", 1e18)), default=None)
    return {"handler_start": at.get("api.handler>"), "submitted": at.get("api.submit<"), "core_add": at.get("core.add>"),
            "core_send_first_token": last_send, "api_deliver": at.get("api.deliver>"), "client_first": at["client.first"],
            "core_steps_before": sum(1 for _, lab in line if lab == "core.step>")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--out", default="serve_timeline.json")
    a = p.parse_args()
    import httpx

    from benchmarks.common import env_info, model_config, write_json, write_model_dir

    work = Path(tempfile.mkdtemp(prefix="nanoserve-timeline-"))
    probe_dir = work / "timeline"
    probe_dir.mkdir()
    cfg = dict(serve.TINY_CONFIG) if a.model == "tiny" else model_config(a.model)
    model_dir = str(write_model_dir(cfg, work / "model"))
    args = serve.parse_args(["--device", a.device, "--max-concurrency", "256", *[f"--server-arg={s}" for s in a.server_arg]])
    os.environ.update(NANOSERVE_TIMELINE_DIR=str(probe_dir),
                      PYTHONPATH=os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]))
    server = serve.ServerProcess(model_dir, args, a.input_len + a.output_len + 16, work / "server.log")
    rng, marks = random.Random(0), []
    try:
        server.wait_ready(600)
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            for i in range(a.requests + 2):  # the first two warm up
                stream_one(client, serve.random_prompts(rng, 1, a.input_len, cfg["vocab_size"])[0], a.output_len,
                           marks if i >= 2 else [])
    finally:
        server.stop()
    os.environ.pop("NANOSERVE_TIMELINE_DIR")
    lines = timelines(probe_dir, marks)
    table = [phases(line) for line in lines]
    ttft = [row["client_first"] for row in table]
    slowest = max(range(len(table)), key=lambda i: ttft[i])
    median = {k: statistics.median(r[k] for r in table if r[k] is not None) for k in table[0]}
    print("TTFT ms:", [round(x, 2) for x in ttft])
    print("median milestones (ms after client.send):", {k: round(v, 3) for k, v in median.items()})
    write_json(a.out, {"env": env_info(), "command": " ".join(sys.argv), "ttft_ms": ttft, "median": median,
                       "requests": table, "slowest_timeline": lines[slowest], "a_median_timeline": lines[len(lines) // 2],
                       "server_command": server.command})
    return 0


if __name__ == "__main__":
    sys.exit(main())
