"""Issue 7's serving check: the real `nanoserve serve` against the offline engine, on real model shapes.

Per shape (random weights: load_format=dummy) it starts `nanoserve serve` and at each concurrency level runs
`nanoserve bench serve`'s load (nanoserve/bench/serve.py), with the API, core and client CPU seconds and the
engine's counters around it; then the same prompts offline (`bench throughput`'s run, max_num_seqs = concurrency),
the offline b=1 step and one prompt's prefill (`bench latency`'s run), and issue 7's targets, met or missed.

    python benchmarks/serve.py                                        # both shapes, concurrency 1 16 64 256
    python benchmarks/serve.py --model qwen3-0.6b --max-concurrency 1 64 --num-prompts 8 256
    python benchmarks/serve.py --smoke --out /tmp/serve.json          # a tiny model on CPU (CI runs this)
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import model_config, write_model_dir  # noqa: E402
from nanoserve.bench.common import BenchRequest, environment, random_requests, write_json  # noqa: E402
from nanoserve.bench.serve import run_load, serving_stack, summarize  # noqa: E402

DEFAULT_MODELS = ["qwen3-0.6b", "llama-3.1-8b"]
DROP_CHECK_PROMPTS = 1000  # at the highest concurrency of the first model: 0 failed or dropped out of these
PROMPTS_PER_LEVEL = {"llama-3.1-8b": 2}  # prompts per level: this × concurrency (at least 8; default 4)
SERVED_NAME = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=None, help=f"model shapes (default {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (1024)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens (128)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=None, help="levels (1 16 64 256)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=None, help="prompts per level, one per level")
    p.add_argument("--drop-check-prompts", type=int, default=DROP_CHECK_PROMPTS,
                   help="prompts at the highest level of the first model (0: as --num-prompts)")
    p.add_argument("--clients", type=int, default=8, help="client processes (at most one per stream)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu")
    p.add_argument("--server-arg", action="append", default=[], help="an extra `nanoserve serve` flag (repeat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, short prompts, levels 1 and 4")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "serve.json"))
    args = p.parse_args(argv)
    smoke = args.smoke
    args.model = args.model or (["tiny"] if smoke else DEFAULT_MODELS)
    args.input_len = args.input_len or (16 if smoke else 1024)
    args.output_len = args.output_len or (8 if smoke else 128)
    args.max_concurrency = args.max_concurrency or ([1, 4] if smoke else [1, 16, 64, 256])
    args.device = args.device or ("cpu" if smoke else "cuda")
    if smoke:
        args.clients, args.drop_check_prompts = min(args.clients, 2), 0
    if args.num_prompts is not None and len(args.num_prompts) != len(args.max_concurrency):
        p.error("--num-prompts needs one number per --max-concurrency level")
    return args


def _cpu_seconds(pid: int | None) -> float | None:
    """user + system CPU time of a process so far (Linux /proc), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


class ServerProcess:
    """`nanoserve serve` as a user starts it; its log goes to a file."""

    def __init__(self, model_dir: str, args: argparse.Namespace, max_model_len: int, log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path, self.base_url, self.core_pid = log_path, f"http://127.0.0.1:{self.port}", None
        self.command = [sys.executable, "-m", "nanoserve", "serve", "--model", model_dir, "--port", str(self.port),
                        "--served-model-name", SERVED_NAME, "--load-format", "dummy", "--skip-tokenizer-init",
                        "--device", args.device, "--max-num-seqs", str(max(args.max_concurrency)),
                        "--max-model-len", str(max_model_len), "--show-progress", "false", *args.server_arg]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> float:
        import httpx

        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nanoserve serve exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"nanoserve serve not ready after {timeout:.0f} s:\n{self.log()[-3000:]}")
            time.sleep(0.5)
        found = re.search(r"engine core ready in [\d.]+ s \(pid (\d+)\)", self.log())
        self.core_pid = int(found.group(1)) if found else None
        return time.monotonic() - start

    def cpu(self) -> dict:
        return {"api_s": _cpu_seconds(self.proc.pid), "core_s": _cpu_seconds(self.core_pid)}

    def metrics(self) -> dict[str, float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


COUNTERS = ("nanoserve_generation_tokens_total", "nanoserve_prompt_tokens_total", "nanoserve_mixed_steps_total",
            "nanoserve_decode_steps_total{graph}", "nanoserve_decode_steps_total{eager}",
            "nanoserve_preemptions_total", "nanoserve_padding_rows_total")


def measure_level(server: ServerProcess, requests: list[BenchRequest], concurrency: int, args) -> dict:
    """One level's figures, with the processes' CPU seconds and the engine's counters around it."""
    cpu0, metrics0 = server.cpu(), server.metrics()
    records, start, client_cpu, clients = run_load(server.base_url, SERVED_NAME, requests, concurrency,
                                                   client_processes=min(args.clients, concurrency))
    result = summarize(records, start)
    cpu1, wall, metrics1 = server.cpu(), result["duration_s"], server.metrics()
    cpu = {k: cpu1[k] - cpu0[k] if cpu1[k] is not None and cpu0[k] is not None else None for k in cpu0}
    cpu.update(clients_s=client_cpu, client_processes=clients, wall_s=wall,
               api_busy=cpu["api_s"] / wall if cpu["api_s"] and wall else None,
               clients_busy=client_cpu / (clients * wall) if wall else None)
    engine = {n: metrics1.get(n, 0.0) - metrics0.get(n, 0.0) for n in COUNTERS}
    print(f"  server c={concurrency:<4} {result['output_throughput'] or 0:9.1f} tok/s  failed {result['failed']} "
          f"dropped {result['dropped']}", flush=True)
    return {"concurrency": concurrency, "num_prompts": len(requests), **result, "cpu": cpu, "engine": engine}


def bench_server(model_dir: str, args, levels, max_model_len: int, vocab: int, work: Path) -> dict:
    server = ServerProcess(model_dir, args, max_model_len, work / "serve.log")
    out: dict = {"command": server.command}
    try:
        out["startup_s"] = server.wait_ready(timeout=1800)
        warm = random_requests(random.Random(args.seed + 99), min(16, max(c for c, _ in levels)), args.input_len, 4,
                               vocab)
        run_load(server.base_url, SERVED_NAME, warm, client_processes=args.clients)  # JIT, allocator: not measured
        out["levels"] = [measure_level(server, requests, c, args) for c, requests in levels]
    finally:
        out["exit_code"] = server.stop()
        out["log_tail"] = server.log()[-2000:]
    return out


def bench_offline(model_dir: str, args, levels, max_model_len: int) -> dict:
    """The same prompts through `nanoserve bench throughput`'s run (LLM, max_num_seqs = concurrency), greedy."""
    import torch

    from nanoserve import LLM
    from nanoserve.bench.common import release_memory
    from nanoserve.bench.offline import run_latency, run_throughput, sampling

    if args.device == "cpu":  # as the server's core process does: one CPU core is the API's
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    out: dict = {"levels": []}
    for concurrency, requests in levels:
        llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, device=args.device,
                  max_num_seqs=concurrency, max_model_len=max_model_len, show_progress=False)
        result = run_throughput(llm, requests, [sampling(args.output_len, 0.0)] * len(requests), log=lambda _: None)
        if concurrency == 1:  # what the concurrency-1 targets compare with: one prompt's prefill, the b=1 step
            prefill, full = (statistics.median(run_latency(llm, 1, args.input_len, n, 5, 0, args.seed + 97,
                                                           log=lambda _: None)["latencies"])
                             for n in (1, args.output_len))
            out.update(prefill_ms=prefill * 1e3, step_ms_b1=(full - prefill) / max(1, args.output_len - 1) * 1e3)
        out["levels"].append({"concurrency": concurrency, "num_prompts": len(requests),
                              "duration_s": result["elapsed_time"],
                              "output_throughput": result["output_tokens_per_second"],
                              "request_throughput": result["requests_per_second"]})
        print(f"  offline c={concurrency:<4} {result['output_tokens_per_second']:9.1f} tok/s", flush=True)
        llm.close()
        del llm
        release_memory()
    return out


def bench_model(name: str, args, drop_check: bool, work: Path) -> dict:
    config = model_config(name)
    model_dir, vocab = str(write_model_dir(name, work / name)), config["vocab_size"]
    max_model_len = args.input_len + args.output_len + 16
    rng = random.Random(args.seed)
    counts = args.num_prompts or [max(8, PROMPTS_PER_LEVEL.get(name, 4) * c) for c in args.max_concurrency]
    levels = []
    for i, (concurrency, count) in enumerate(zip(args.max_concurrency, counts)):
        if drop_check and i == len(args.max_concurrency) - 1:
            count = max(count, args.drop_check_prompts)
        levels.append((concurrency, random_requests(rng, count, args.input_len, args.output_len, vocab)))
    print(f"{name}: {len(levels)} levels, {args.input_len} in / {args.output_len} out", flush=True)
    server = bench_server(model_dir, args, levels, max_model_len, vocab, work)
    offline = bench_offline(model_dir, args, levels, max_model_len)
    for s, o in zip(server.get("levels", []), offline["levels"]):
        s["offline_output_throughput"] = o["output_throughput"]
        s["ratio_to_offline"] = s["output_throughput"] / o["output_throughput"] if s["output_throughput"] else None
    result = {"model": name, "config": config, "max_model_len": max_model_len, "server": server, "offline": offline}
    result["targets"] = targets(result, drop_check)
    return result


def _target(what: str, value, limit, met_if: str) -> dict:
    met = value is not None and limit is not None and (value >= limit if met_if == ">=" else value <= limit)
    return {"target": what, "value": value, "limit": limit, "met": met,
            "margin": None if value is None or not limit else value / limit - 1}


def targets(result: dict, drop_check: bool) -> list[dict]:
    """Issue 7's targets; margin = value / limit - 1 (positive: above the limit)."""
    levels, offline = result["server"].get("levels", []), result["offline"]
    out = []
    for lv in levels:
        c, itl = lv["concurrency"], lv["itl_ms"]
        out.append(_target(f"c={c}: server output tok/s >= 85% of offline", lv["output_throughput"],
                           0.85 * lv["offline_output_throughput"], ">="))
        out.append(_target(f"c={c}: ITL p99 <= 3 x ITL p50", itl and itl["p99"], itl and 3 * itl["p50"], "<="))
    first = next((lv for lv in levels if lv["concurrency"] == 1), None)
    if first is not None and "step_ms_b1" in offline:
        out.append(_target("c=1: TPOT p50 <= 1.1 x offline b=1 step", first["tpot_ms"] and first["tpot_ms"]["p50"],
                           1.1 * offline["step_ms_b1"], "<="))
        out.append(_target("c=1: TTFT p50 <= prefill + 5 ms", first["ttft_ms"] and first["ttft_ms"]["p50"],
                           offline["prefill_ms"] + 5.0, "<="))
    if drop_check and levels:
        last = levels[-1]
        lost = last["failed"] + last["dropped"]
        out.append({"target": f"0 failed or dropped of {last['num_prompts']} at c={last['concurrency']}",
                    "value": lost, "limit": 0, "met": lost == 0, "margin": None})
    by_c = {lv["concurrency"]: lv["output_throughput"] for lv in levels}
    if 64 in by_c and 256 in by_c:
        out.append(_target("throughput does not fall from c=64 to c=256", by_c[256], by_c[64], ">="))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = environment()
    report = {"benchmark": "serve", **env, "serving_stack": serving_stack(),
              "machine": {"host": env["host"], "cpu": env["cpu"], "cpu_count": env["cpu_count"]},
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": []}
    with tempfile.TemporaryDirectory(prefix="nanoserve-serve-bench-") as tmp:
        for i, name in enumerate(args.model):
            report["models"].append(bench_model(name, args, drop_check=(i == 0 and args.drop_check_prompts > 0),
                                                work=Path(tmp)))
            write_json(args.out, report)  # after each model: a later failure keeps what was measured
    for model in report["models"]:
        for t in model["targets"]:
            value, limit = (("n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
                            for v in (t["value"], t["limit"]))
            print(f"{model['model']:>14}  {'met   ' if t['met'] else 'MISSED'}  {t['target']}: {value} (limit {limit})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
