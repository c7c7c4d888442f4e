"""`nanoserve bench serve`: streamed /v1/completions against a running OpenAI-compatible server, reported as
`vllm bench serve` reports it (TTFT, TPOT, ITL, E2EL; request and token throughput).

The load comes from several client processes (so the load generator is not the bottleneck), each opening its
connections and importing what a first request would otherwise pay (~70-100 ms that showed as one slow TTFT in
8 at one stream) before a barrier; the clock starts when every process is past it. Requests are sent at their
arrival times (all at once, or a seeded Poisson process for --request-rate), at most --max-concurrency streams
at a time in all. A request fails on an HTTP or transport error; it is dropped when its stream ends without
[DONE] or without every token asked for (every request sets ignore_eos, so its length is known). A server
started with --api-key is sent OPENAI_API_KEY. ITL is per
streamed chunk, as in vllm bench serve: a server that falls behind merges tokens into fewer chunks
(tokens_per_chunk shows it) rather than queueing them.
"""
from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field

from nanoserve.bench.common import BenchRequest, arrival_offsets, distribution

COMPLETIONS = "/v1/completions"


@dataclass
class RequestRecord:
    start: float
    expected_tokens: int = 0
    prompt_len: int = 0
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

    @property
    def ok(self) -> bool:
        return self.error is None and self.done and self.num_tokens == self.expected_tokens


async def _one_request(client, endpoint: str, model: str, request: BenchRequest) -> RequestRecord:
    import msgspec

    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    record = RequestRecord(start=time.monotonic(), expected_tokens=request.output_len, prompt_len=request.prompt_len)
    try:
        async with client.stream("POST", endpoint, json=body) as response:
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


@dataclass
class _Share:
    """One client process's part of the load: its requests, their arrival offsets, its streams."""

    base_url: str
    endpoint: str
    model: str
    requests: list[BenchRequest]
    offsets: list[float]
    streams: int


async def _client_main(share: _Share, barrier) -> dict:
    import httpx
    import msgspec  # noqa: F401 (imported before the clock starts)

    limits = httpx.Limits(max_connections=share.streams + 4, max_keepalive_connections=share.streams + 4)
    async with httpx.AsyncClient(base_url=share.base_url, limits=limits, timeout=httpx.Timeout(1800.0),
                                 headers=api_key_header()) as client:
        semaphore = asyncio.Semaphore(share.streams)

        async def send(request: BenchRequest, offset: float, t0: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            async with semaphore:
                return await _one_request(client, share.endpoint, share.model, request)

        try:
            await asyncio.gather(*(client.get("/health") for _ in range(share.streams)))  # the connections, opened
        except Exception:
            barrier.abort()  # the parent raises at once rather than waiting for this process
            raise
        barrier.wait()  # every client process starts sending at the same moment
        cpu0, t0 = time.process_time(), time.monotonic()
        records = await asyncio.gather(*(send(r, o, t0) for r, o in zip(share.requests, share.offsets)))
        return {"records": [vars(r) for r in records], "cpu_s": time.process_time() - cpu0}


def _client_process(share: _Share, barrier, results) -> None:
    results.put(asyncio.run(_client_main(share, barrier)))


def api_key_header() -> dict:
    """Authorization for a server started with --api-key: OPENAI_API_KEY, as OpenAI's clients read it."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def default_client_processes(streams: int) -> int:
    """Enough processes that the chunk rate, not the client, is the limit; no more than the machine's cores allow."""
    return max(1, min(8, streams, (os.cpu_count() or 2) // 2))


def run_load(base_url: str, model: str, requests: list[BenchRequest], max_concurrency: int | None = None,
             request_rate: float = math.inf, seed: int = 0, client_processes: int | None = None,
             endpoint: str = COMPLETIONS) -> tuple[list[RequestRecord], float, float, int]:
    """(records, start time, client CPU seconds, client processes): the requests sent at their arrival times,
    at most max_concurrency streams at a time in all (None: no limit)."""
    if not endpoint.rstrip("/").endswith("/completions") or endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--endpoint {endpoint!r}: nanoserve bench serve streams the completions API "
                         f"({COMPLETIONS})")
    streams = len(requests) if max_concurrency is None else max_concurrency
    if streams < 1:
        raise ValueError(f"--max-concurrency must be positive, got {max_concurrency}")
    streams = min(streams, len(requests))
    offsets = arrival_offsets(len(requests), request_rate, seed)
    num = max(1, min(client_processes or default_client_processes(streams), streams))
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(num + 1), spawn.Queue()
    shares = [_Share(base_url, endpoint, model, requests[i::num], offsets[i::num], streams // num + (i < streams % num))
              for i in range(num)]
    procs = [spawn.Process(target=_client_process, args=(share, barrier, results), daemon=True) for share in shares]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=300)
    except Exception:
        raise ValueError(f"the client processes could not connect to {base_url} (is the server up?)") from None
    start = time.monotonic()
    outs = [results.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join(30)
    records = [RequestRecord(**r) for out in outs for r in out["records"]]
    return records, start, sum(out["cpu_s"] for out in outs), num


def summarize(records: list[RequestRecord], start: float) -> dict:
    """The figures of one run, from its records (ms for latencies; per second for throughputs)."""
    failed = [r for r in records if r.error is not None]
    ok = [r for r in records if r.ok]
    dropped = len(records) - len(failed) - len(ok)
    duration = max((r.end for r in records), default=start) - start
    tokens = sum(r.num_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.end - r.start - r.ttft) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]
    chunks = sum(len(r.chunk_tokens) for r in ok)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    return {
        "completed": len(ok), "failed": len(failed), "dropped": dropped,
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": tokens,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(tokens),
        "total_token_throughput": per_s(tokens + sum(r.prompt_len for r in ok)),
        "ttft_ms": distribution([r.ttft for r in ok]), "tpot_ms": distribution(tpot), "itl_ms": distribution(itl),
        "ttft_ms_in_order": [round(r.ttft * 1e3, 2) for r in sorted(ok, key=lambda r: r.start)][:64],
        "e2el_ms": distribution([r.end - r.start for r in ok]),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "usage_matches": all(r.usage_tokens == r.num_tokens for r in ok),
    }


def format_summary(result: dict) -> str:
    """The result as `vllm bench serve` prints it."""
    def row(name: str, value, spec: str = ".2f") -> str:
        return f"{name:<40}{'n/a' if value is None else format(value, spec):>12}"

    lines = ["=" * 16 + " Serving Benchmark Result " + "=" * 16,
             row("Successful requests:", result["completed"], "d"), row("Failed requests:", result["failed"], "d"),
             row("Dropped streams:", result["dropped"], "d"),
             row("Benchmark duration (s):", result["duration_s"]),
             row("Total input tokens:", result["total_input_tokens"], "d"),
             row("Total generated tokens:", result["total_output_tokens"], "d"),
             row("Request throughput (req/s):", result["request_throughput"]),
             row("Output token throughput (tok/s):", result["output_throughput"]),
             row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short, d = key.split("_")[0].upper(), result[key] or {}
        lines += [f"{title:-^58}", row(f"Mean {short} (ms):", d.get("mean")),
                  row(f"Median {short} (ms):", d.get("p50")), row(f"P99 {short} (ms):", d.get("p99"))]
    lines += [f"{'':=^58}"] + [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------------------------


def run_serve_command(args) -> dict:
    """`nanoserve bench serve`: the workload, a checked warm-up, the timed run, the report printed; the figures."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model, root = served_model(base_url, args.model)
    requests = serve_requests(args, model, root)
    if args.num_warmups > 0:  # also checks the endpoint: a wrong URL or model fails here, with the server's answer
        warm = [BenchRequest(r.prompt, r.prompt_len, min(r.output_len, 4)) for r in requests[:args.num_warmups]]
        records, _, _, _ = run_load(base_url, model, warm, endpoint=args.endpoint, client_processes=1)
        bad = [r for r in records if not r.ok]
        if bad:
            raise ValueError(f"the warm-up request to {base_url}{args.endpoint} failed: "
                             f"{bad[0].error or 'the stream ended early'}")
    print(f"{len(requests)} requests to {base_url}{args.endpoint} ({model}), request rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency or 'none'}", flush=True)
    records, start, client_cpu, processes = run_load(base_url, model, requests, args.max_concurrency,
                                                     args.request_rate, args.seed, args.client_processes, args.endpoint)
    result = summarize(records, start)
    result.update(num_prompts=len(requests), client_cpu_s=client_cpu, client_processes=processes,
                  serving_stack=serving_stack())
    print(format_summary(result))
    return result


def serving_stack() -> dict:
    """Versions of the HTTP / IPC stack here (None: not installed; uvicorn then runs asyncio's loop and h11)."""
    stack = {}
    for name in ("fastapi", "uvicorn", "httpx", "zmq", "msgspec", "uvloop", "httptools"):
        try:
            stack[name] = __import__(name).__version__
        except Exception:
            stack[name] = None
    return stack


def served_model(base_url: str, model: str | None) -> tuple[str, str | None]:
    """`model`, or the first model the server lists (GET /v1/models, which also checks that the server is up), and
    the path its card gives as `root` (None when it gives none)."""
    import httpx

    try:
        response = httpx.get(base_url + "/v1/models", timeout=30, headers=api_key_header())
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url} (is the server up? --base-url, --host, --port): {e}") from None
    try:
        cards = [card for card in response.json()["data"] if isinstance(card, dict) and "id" in card]
    except (ValueError, KeyError, TypeError):
        cards = []
    card = next((c for c in cards if model is None or c["id"] == model), None)
    if card is None and model is None:
        raise ValueError(f"{base_url}/v1/models answered {response.status_code} without a model: give --model")
    root = card.get("root") if card is not None else None
    return (model or card["id"]), (root if isinstance(root, str) else None)


def serve_requests(args, model: str, root: str | None = None) -> list[BenchRequest]:
    """Random token ids below the model's vocabulary, or the dataset's conversations (lengths by its tokenizer)."""
    import random

    from nanoserve.bench.common import load_sharegpt, random_requests

    source = _tokenizer_source(args, model, root)
    if args.dataset_path:
        return load_sharegpt(args.dataset_path, _tokenizer(source), args.num_prompts, args.output_len, seed=args.seed)
    return random_requests(random.Random(args.seed), args.num_prompts, args.input_len,
                           args.output_len or args.default_output_len, _vocab_size(source))


def _tokenizer_source(args, model: str, root: str | None) -> str:
    """--tokenizer; else the path the server says it serves (its card's root) when it is on this machine: a
    --served-model-name is no path; else the model's name (a path or hub id when the server is started by one)."""
    if args.tokenizer:
        return args.tokenizer
    if root is not None and os.path.exists(root):
        return root
    return args.model or model


def _tokenizer(source: str):
    from nanoserve.model_files import load_tokenizer

    try:
        return load_tokenizer(source)
    except Exception as e:  # a served name that is not a path, a folder without one: say what to give
        raise ValueError(f"cannot load a tokenizer from {source!r} ({type(e).__name__}: {e}); give --tokenizer "
                         "(a model folder, .gguf file or hub id)") from None


def _vocab_size(source: str) -> int:
    """Random ids need only the vocabulary's size: the tokenizer's, else the model config's (a folder without one)."""
    from nanoserve.model_files import load_hf_config

    try:
        return len(_tokenizer(source))
    except ValueError as no_tokenizer:
        try:
            return int(load_hf_config(source).vocab_size)
        except Exception:
            raise no_tokenizer from None


__all__ = ["RequestRecord", "run_load", "summarize", "format_summary", "run_serve_command", "COMPLETIONS"]
