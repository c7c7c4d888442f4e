"""Serving benchmark in the vocabulary of `vllm bench serve`: the real `nanoserve serve` against the offline engine.

For each model shape (random weights with the real config: load_format=dummy, skip_tokenizer_init) it
  * starts `nanoserve serve` as a subprocess and, at each concurrency level, streams /v1/completions for
    random token-id prompts (--input-len in, --output-len out, ignore_eos, include_usage, return_token_ids)
    from several client processes (so the load generator is not the bottleneck), all sending at once;
  * reports output tok/s, requests/s, TTFT, TPOT, ITL and E2E latency (mean/p50/p99/max), failed requests
    (an HTTP or transport error) and dropped ones (a stream that ends without [DONE] or without every token),
    the CPU seconds of the API process, the core process and the clients, and the engine's step counters;
  * then runs the SAME prompts through the offline engine (LLM, max_num_seqs = concurrency) in this process,
    and reports server / offline; plus the offline b=1 step time and one prompt's prefill time;
  * checks the targets of issue 7 and says by how much each is met or missed.
Results (machine, versions, date, command, commit) go to --out as JSON.

ITL is per streamed chunk, as in vllm bench serve: when the API process falls behind, the server merges
tokens into fewer chunks (tokens_per_chunk shows it) rather than queueing them.

    python benchmarks/serve.py                                        # both shapes, concurrency 1 16 64 256
    python benchmarks/serve.py --model qwen3-0.6b --max-concurrency 1 64 --num-prompts 8 256
    python benchmarks/serve.py --smoke --out /tmp/serve.json          # a tiny model on CPU (CI runs this)
"""
from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
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
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # nanoserve, benchmarks.common
# Client processes are spawned and re-import this file: torch (via benchmarks.common, nanoserve) is imported
# only inside the functions that need it, so a client process starts in a fraction of a second.

DEFAULT_MODELS = ["qwen3-0.6b", "llama-3.1-8b"]
DEFAULT_CONCURRENCY = [1, 16, 64, 256]
DROP_CHECK_PROMPTS = 1000  # at the highest concurrency of the first model: 0 failed or dropped out of these
PROMPTS_PER_LEVEL = 4  # default prompts per level: this × concurrency (at least 8) ...
PROMPTS_PER_LEVEL_BY_MODEL = {"llama-3.1-8b": 2}  # ... fewer where 1024-token prefills dominate the run time
SERVED_NAME = "bench"
TINY_CONFIG = {  # --smoke: a small Qwen3 (real code path, seconds on a CPU)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "vocab_size": 512, "tie_word_embeddings": True, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=None, help=f"model shapes (default {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--input-len", "--random-input-len", type=int, default=None, help="prompt tokens (1024)")
    p.add_argument("--output-len", "--random-output-len", type=int, default=None, help="generated tokens (128)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=None, help="levels (1 16 64 256)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=None,
                   help="prompts per level, one number per level (default max(8, 4 x concurrency); 2 x for "
                        "llama-3.1-8b)")
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
    args.max_concurrency = args.max_concurrency or ([1, 4] if smoke else DEFAULT_CONCURRENCY)
    args.device = args.device or ("cpu" if smoke else "cuda")
    if smoke:
        args.clients, args.drop_check_prompts = min(args.clients, 2), 0
    if args.num_prompts is not None and len(args.num_prompts) != len(args.max_concurrency):
        p.error("--num-prompts needs one number per --max-concurrency level")
    return args


# ---- the server process ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.port, self.log_path = _free_port(), log_path
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "nanoserve", "serve", "--model", model_dir, "--port", str(self.port),
               "--served-model-name", SERVED_NAME, "--load-format", "dummy", "--skip-tokenizer-init",
               "--device", args.device, "--max-num-seqs", str(max(args.max_concurrency)),
               "--max-model-len", str(max_model_len), "--show-progress", "false", *args.server_arg]
        self.command = cmd
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.core_pid: int | None = None

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


# ---- the load generator -----------------------------------------------------------------------------


@dataclass
class RequestRecord:
    start: float
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    done: bool = False  # the stream ended with [DONE]
    usage_tokens: int | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_tokens)


async def _one_request(client, prompt: list[int], output_len: int) -> RequestRecord:
    import msgspec

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    record = RequestRecord(start=time.monotonic())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            buffer = b""
            async for data in response.aiter_raw():
                now = time.monotonic()
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    _take_event(record, event, now, msgspec.json.decode)
    except Exception as e:  # transport errors, timeouts: a failed request, not a crashed benchmark
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.monotonic()
    return record


def _take_event(record: RequestRecord, event: bytes, now: float, decode) -> None:
    if not event.startswith(b"data: "):
        return
    payload = event[6:]
    if payload == b"[DONE]":
        record.done = True
        return
    message = decode(payload)
    if "error" in message:
        record.error = str(message["error"].get("message"))
        return
    if message.get("usage") and not message.get("choices"):
        record.usage_tokens = message["usage"]["completion_tokens"]
        return
    tokens = sum(len(c.get("token_ids") or ()) for c in message.get("choices", ()))
    if tokens:
        if record.ttft is None:
            record.ttft = now - record.start
        record.chunk_times.append(now)
        record.chunk_tokens.append(tokens)


async def _client_main(base_url: str, prompts: list[list[int]], streams: int, output_len: int, barrier) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(1800.0)) as client:
        semaphore = asyncio.Semaphore(streams)

        async def guarded(prompt):
            async with semaphore:
                return await _one_request(client, prompt, output_len)

        # Before the clock starts: what a client's first request would otherwise pay (msgspec's import, one TCP
        # connection per stream, httpx's lazy set-up), ~70-100 ms that showed as one slow TTFT in 8 at 1 stream.
        import msgspec  # noqa: F401
        await asyncio.gather(*(client.get("/health") for _ in range(streams)))
        barrier.wait()  # every client process starts sending at the same moment
        cpu0 = time.process_time()
        records = await asyncio.gather(*(guarded(p) for p in prompts))
        return {"records": [vars(r) for r in records], "cpu_s": time.process_time() - cpu0}


def _client_process(base_url, prompts, streams, output_len, barrier, results) -> None:
    results.put(asyncio.run(_client_main(base_url, prompts, streams, output_len, barrier)))


def run_load(base_url: str, prompts: list[list[int]], concurrency: int, output_len: int,
             max_clients: int) -> tuple[list[RequestRecord], float, float, int]:
    """(records, start time, client CPU seconds, client processes): `concurrency` streams at a time in all."""
    num_clients = max(1, min(max_clients, concurrency))  # spread wide: the chunk rate, not the streams, costs
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(num_clients + 1), spawn.Queue()
    shares = [concurrency // num_clients + (i < concurrency % num_clients) for i in range(num_clients)]
    procs = [spawn.Process(target=_client_process, daemon=True,
                           args=(base_url, prompts[i::num_clients], shares[i], output_len, barrier, results))
             for i in range(num_clients)]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=300)
    start = time.monotonic()
    outs = [results.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join(30)
    records = [RequestRecord(**r) for out in outs for r in out["records"]]
    return records, start, sum(out["cpu_s"] for out in outs), num_clients


# ---- metrics ------------------------------------------------------------------------------------------


def _dist(values: list[float], scale: float = 1e3) -> dict | None:
    """mean / p50 / p99 / max (ms by default), as vllm bench serve reports them."""
    if not values:
        return None
    ordered = sorted(v * scale for v in values)

    def pct(q: float) -> float:
        k = (len(ordered) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p99": pct(0.99), "max": ordered[-1]}


def summarize(records: list[RequestRecord], start: float, input_len: int, output_len: int) -> dict:
    failed = [r for r in records if r.error is not None]
    dropped = [r for r in records if r.error is None and not (r.done and r.num_tokens == output_len)]
    ok = [r for r in records if r.error is None and r.done and r.num_tokens == output_len]
    duration = max((r.end for r in records), default=start) - start
    tokens = sum(r.num_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.end - r.start - r.ttft) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]
    chunks = sum(len(r.chunk_tokens) for r in ok)
    return {
        "completed": len(ok), "failed": len(failed), "dropped": len(dropped),
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": tokens / duration if duration > 0 else None,
        "total_token_throughput": (tokens + len(ok) * input_len) / duration if duration > 0 else None,
        "ttft_ms": _dist([r.ttft for r in ok]), "tpot_ms": _dist(tpot), "itl_ms": _dist(itl),
        "ttft_ms_in_order": [round(r.ttft * 1e3, 2) for r in sorted(ok, key=lambda r: r.start)][:64],
        "e2el_ms": _dist([r.end - r.start for r in ok]),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "usage_matches": all(r.usage_tokens == r.num_tokens for r in ok),
    }


def _counter_deltas(before: dict, after: dict) -> dict:
    names = ("nanoserve_generation_tokens_total", "nanoserve_prompt_tokens_total", "nanoserve_mixed_steps_total",
             "nanoserve_decode_steps_total{graph}", "nanoserve_decode_steps_total{eager}",
             "nanoserve_preemptions_total", "nanoserve_padding_rows_total")
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


# ---- one model --------------------------------------------------------------------------------------------


def random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def bench_server(model_dir: str, args, levels: list[tuple[int, list[list[int]]]], max_model_len: int,
                 vocab: int, work: Path) -> dict:
    server = ServerProcess(model_dir, args, max_model_len, work / "serve.log")
    out: dict = {"command": server.command}
    try:
        out["startup_s"] = server.wait_ready(timeout=1800)
        warm = random_prompts(random.Random(args.seed + 99), min(16, max(c for c, _ in levels)), args.input_len, vocab)
        run_load(server.base_url, warm, len(warm), 4, args.clients)  # JIT and allocator warm-up, not measured
        out["levels"] = []
        for concurrency, prompts in levels:
            cpu0, metrics0 = server.cpu(), server.metrics()
            records, start, client_cpu, num_clients = run_load(server.base_url, prompts, concurrency,
                                                               args.output_len, args.clients)
            result = summarize(records, start, args.input_len, args.output_len)
            cpu1 = server.cpu()
            wall = result["duration_s"]
            result["cpu"] = {k: (cpu1[k] - cpu0[k]) if cpu1[k] is not None and cpu0[k] is not None else None
                             for k in cpu0}
            result["cpu"].update(clients_s=client_cpu, client_processes=num_clients, wall_s=wall,
                                 api_busy=result["cpu"]["api_s"] / wall if result["cpu"]["api_s"] and wall else None,
                                 clients_busy=client_cpu / (num_clients * wall) if wall else None)
            result["engine"] = _counter_deltas(metrics0, server.metrics())
            out["levels"].append({"concurrency": concurrency, "num_prompts": len(prompts), **result})
            print(f"  server c={concurrency:<4} {result['output_throughput'] or 0:9.1f} tok/s  "
                  f"failed {result['failed']} dropped {result['dropped']}", flush=True)
    finally:
        out["exit_code"] = server.stop()
        out["log_tail"] = server.log()[-2000:]
    return out


def bench_offline(model_dir: str, args, levels: list[tuple[int, list[list[int]]]], max_model_len: int,
                  vocab: int) -> dict:
    from benchmarks.common import release_cuda_memory
    from nanoserve import LLM, SamplingParams

    import torch

    if args.device == "cpu":  # as the server's core process does: one CPU core is the API's
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    out: dict = {"levels": []}
    for concurrency, prompts in levels:
        llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, device=args.device,
                  max_num_seqs=concurrency, max_model_len=max_model_len, show_progress=False)
        llm.generate(random_prompts(random.Random(args.seed + 98), 2, args.input_len, vocab),
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        if concurrency == 1:
            out.update(single_request_times(llm, args, vocab))
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        out["levels"].append({"concurrency": concurrency, "num_prompts": len(prompts), "duration_s": seconds,
                              "output_throughput": tokens / seconds, "request_throughput": len(prompts) / seconds})
        print(f"  offline c={concurrency:<4} {tokens / seconds:9.1f} tok/s", flush=True)
        del llm, results
        release_cuda_memory()
    return out


def single_request_times(llm, args, vocab: int, repeats: int = 5) -> dict:
    """The offline b=1 numbers the concurrency-1 targets compare with: one prompt's prefill (generate with
    max_tokens=1) and the decode step ((generate output_len - prefill) / (output_len - 1)), medians."""
    from nanoserve import SamplingParams

    prompts = random_prompts(random.Random(args.seed + 97), 2 * repeats, args.input_len, vocab)
    prefill, full = [], []
    for i in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts[2 * i], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        prefill.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(prompts[2 * i + 1], SamplingParams(max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
        full.append(time.perf_counter() - start)
    prefill_s, full_s = statistics.median(prefill), statistics.median(full)
    return {"prefill_ms": prefill_s * 1e3, "step_ms_b1": (full_s - prefill_s) / max(1, args.output_len - 1) * 1e3}


def bench_model(name: str, args, drop_check: bool, work: Path) -> dict:
    from benchmarks.common import model_config, write_model_dir

    config = dict(TINY_CONFIG) if name == "tiny" else model_config(name)
    model_dir = str(write_model_dir(config, work / name))
    vocab = config["vocab_size"]
    max_model_len = args.input_len + args.output_len + 16
    rng = random.Random(args.seed)
    per_level = PROMPTS_PER_LEVEL_BY_MODEL.get(name, PROMPTS_PER_LEVEL)
    counts = args.num_prompts or [max(8, per_level * c) for c in args.max_concurrency]
    levels = []
    for i, (concurrency, count) in enumerate(zip(args.max_concurrency, counts)):
        if drop_check and i == len(args.max_concurrency) - 1:
            count = max(count, args.drop_check_prompts)
        levels.append((concurrency, random_prompts(rng, count, args.input_len, vocab)))
    print(f"{name}: {len(levels)} levels, {args.input_len} in / {args.output_len} out", flush=True)
    server = bench_server(model_dir, args, levels, max_model_len, vocab, work)
    offline = bench_offline(model_dir, args, levels, max_model_len, vocab)
    for s, o in zip(server.get("levels", []), offline["levels"]):
        s["offline_output_throughput"] = o["output_throughput"]
        s["ratio_to_offline"] = s["output_throughput"] / o["output_throughput"] if s["output_throughput"] else None
    result = {"model": name, "config": config, "max_model_len": max_model_len, "server": server, "offline": offline}
    result["targets"] = targets(result, drop_check)
    return result


def _target(what: str, value, limit, met_if: str) -> dict:
    met = value is not None and limit is not None and (value >= limit if met_if == ">=" else value <= limit)
    margin = None if value is None or not limit else value / limit - 1
    return {"target": what, "value": value, "limit": limit, "met": met, "margin": margin}


def targets(result: dict, drop_check: bool) -> list[dict]:
    """Issue 7's targets; margin = value / limit - 1 (positive: above the limit)."""
    levels, offline = result["server"].get("levels", []), result["offline"]
    out = []
    for lv in levels:
        c = lv["concurrency"]
        out.append(_target(f"c={c}: server output tok/s >= 85% of offline", lv["output_throughput"],
                           0.85 * lv["offline_output_throughput"], ">="))
        itl = lv["itl_ms"]
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


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _serving_stack() -> dict:
    stack = {}
    for name in ("fastapi", "uvicorn", "httpx", "zmq", "msgspec", "uvloop", "httptools"):
        try:
            stack[name] = __import__(name).__version__
        except Exception:  # not installed: uvicorn then runs asyncio's loop and h11
            stack[name] = None
    return stack


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import env_info, write_json

    args = parse_args(argv)
    report = {"benchmark": "serve", **env_info(), "serving_stack": _serving_stack(),
              "machine": {"host": socket.gethostname(), "cpu": _cpu_model(), "cpu_count": os.cpu_count()},
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": []}
    with tempfile.TemporaryDirectory(prefix="nanoserve-serve-bench-") as tmp:
        for i, name in enumerate(args.model):
            report["models"].append(bench_model(name, args, drop_check=(i == 0 and args.drop_check_prompts > 0),
                                                work=Path(tmp)))
            write_json(args.out, report)  # after each model: a later failure keeps what was measured
    for model in report["models"]:
        for t in model["targets"]:
            print(f"{model['model']:>14}  {'met   ' if t['met'] else 'MISSED'}  {t['target']}: {_fmt(t['value'])} "
                  f"(limit {_fmt(t['limit'])})")
    print(f"wrote {args.out}")
    return 0


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    raise SystemExit(main())
