"""`nanoserve bench latency | throughput | serve | graphs`: the flags (in `vllm bench`'s vocabulary) and the
commands. Light at import, like nanoserve/cli.py: the engine, torch and httpx load when a command runs."""
from __future__ import annotations

import argparse
import json
import math
import sys

from nanoserve.config import FIELD_HELP

EPILOG = "Results: --output-json PATH writes the figures with the machine, versions, date, commit and command line."


def add_bench_parser(sub, add_engine_flags) -> None:
    """The `bench` command and its four subcommands; add_engine_flags(parser) adds EngineConfig's flags."""
    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve (a running server), graphs",
                           description="Benchmarks in vllm bench's vocabulary. " + EPILOG)
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="latency|throughput|serve|graphs")
    latency = kinds.add_parser("latency", help="seconds per end-to-end batch (avg, p10 … p99)", epilog=EPILOG,
                               description="One batch of --batch-size random prompts generated end to end, timed "
                               "over --num-iters runs after --num-iters-warmup (fresh prompts each run).")
    _add_model(latency)
    _add_lengths(latency, input_len=32, output_len=128)
    latency.add_argument("--batch-size", type=int, default=8, help="(default: %(default)s)")
    latency.add_argument("--num-iters", type=int, default=30, help="timed runs (default: %(default)s)")
    latency.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs first (default: %(default)s)")
    latency.add_argument("--profile", action="store_true", help="then one more batch under torch.profiler (CUDA): "
                         "the time of each kind of kernel (experts, routing, attention, products, norms, ...)")
    _add_output(latency)
    add_engine_flags(latency)
    throughput = kinds.add_parser("throughput", help="offline requests/s and tokens/s over --num-prompts requests",
                                  epilog=EPILOG, description="--num-prompts requests through the offline engine (LLM) "
                                  "in one generate call: random token ids, or --dataset-path (ShareGPT JSON).")
    _add_model(throughput)
    _add_workload(throughput)
    _add_output(throughput)
    add_engine_flags(throughput)
    _add_serve_parser(kinds)
    _add_graphs_parser(kinds, add_engine_flags)


def _add_model(parser) -> None:
    parser.add_argument("--model", required=True, help=FIELD_HELP["model"])


def _add_lengths(parser, input_len: int, output_len: int | None) -> None:
    parser.add_argument("--input-len", type=int, default=input_len, help="prompt tokens each, random token ids "
                        "(default: %(default)s)")
    shown = f"default: {output_len}" + (", or a dataset reply's length" if parser.prog.endswith(("throughput", "serve"))
                                        else "")
    parser.add_argument("--output-len", type=int, default=None, help=f"tokens to generate each ({shown})")
    parser.set_defaults(default_output_len=output_len)


def _add_workload(parser) -> None:
    _add_lengths(parser, input_len=1024, output_len=128)
    parser.add_argument("--num-prompts", type=int, default=1000, help="(default: %(default)s)")
    parser.add_argument("--dataset-path", default=None, metavar="FILE",
                        help="a ShareGPT-format JSON file: prompts are each conversation's first human turn, output "
                             "lengths its gpt reply's tokens (unless --output-len); default: random token ids")


def _add_output(parser) -> None:
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON")


def _add_serve_parser(kinds) -> None:
    serve = kinds.add_parser("serve", help="TTFT / TPOT / ITL / E2EL and throughput against a running server",
                             epilog=EPILOG, description="Streams the completions API of a running OpenAI-compatible "
                             "server (nanoserve serve, vllm serve, ...) from several client processes.")
    serve.add_argument("--base-url", default=None, help="the server, e.g. http://host:8000 (default: --host, --port)")
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--endpoint", default="/v1/completions", help="(default: %(default)s)")
    serve.add_argument("--model", default=None, help="the model name requests carry (default: the server's first)")
    serve.add_argument("--tokenizer", default=None, help="where the tokenizer is read from, for random token ids and "
                       "dataset lengths (default: the path the server's /v1/models gives as root, when it is on this machine; "
                       "else --model)")
    _add_workload(serve)
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second, Poisson arrivals (seeded by --seed); inf: all at once (default)")
    serve.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: %(default)s)")
    serve.add_argument("--num-warmups", type=int, default=1, help="requests sent (and checked) before the timed "
                       "run (default: %(default)s)")
    serve.add_argument("--client-processes", type=int, default=None, metavar="N",
                       help="load-generating processes (default: up to 8, half the CPU cores)")
    _add_output(serve)


def _add_graphs_parser(kinds, add_engine_flags) -> None:
    graphs = kinds.add_parser(
        "graphs", help="per CUDA-graph size: replay/eager ms and pool MiB; padding of powers of two vs the plan",
        description="Measures the powers of two, plans sizes from their step-time curve, measures the plan "
        "(the report chooses its own capture sizes; unless given, --max-model-len is max(1024, context) and "
        "--num-kv-blocks what max_num_seqs rows of --context tokens need, so its engines fit side by side).")
    _add_model(graphs)
    graphs.add_argument("--distribution", default="uniform", metavar="uniform|FILE",
                        help="batch sizes to plan for: uniform over 1..max_num_seqs, or a recorded histogram")
    graphs.add_argument("--context", type=int, default=512, help="tokens in the KV cache per row")
    graphs.add_argument("--warmup", type=int, default=3, help="untimed calls before each timing")
    graphs.add_argument("--iters", type=int, default=20, help="timed calls per size (median reported)")
    graphs.add_argument("--png", default=None, metavar="PATH", help="plot step time against rows with the sizes")
    graphs.add_argument("--json", "--output-json", dest="json", default=None, metavar="PATH",
                        help="write the whole report as JSON")
    add_engine_flags(graphs)


def run_bench(args: argparse.Namespace, engine_options: dict) -> int:
    """Run `nanoserve bench <kind>`; returns the exit code."""
    if args.bench_command == "graphs":
        return _graphs(args, engine_options)
    if args.bench_command == "serve":
        from nanoserve.bench.serve import run_serve_command

        return _finish(args, run_serve_command(args))
    for name in ("input_len", "output_len", "num_prompts", "batch_size", "num_iters"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    from nanoserve import LLM
    from nanoserve.bench import offline

    if getattr(args, "profile", False):
        import torch

        device = str(engine_options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        if not device.startswith("cuda"):
            raise ValueError("--profile reads the GPU's kernels: it needs a CUDA device")
    llm = LLM(args.model, **{"show_progress": False, **engine_options})
    seed = engine_options.get("seed") or 0
    output_len = args.output_len or args.default_output_len
    if args.bench_command == "latency":
        result = offline.run_latency(llm, args.batch_size, args.input_len, output_len, args.num_iters,
                                     args.num_iters_warmup, seed)
        if args.profile:
            result["profile"] = offline.profile_batch(llm, args.batch_size, args.input_len, output_len, seed)
    else:
        requests = offline.throughput_requests(llm, args.num_prompts, args.input_len,
                                               args.output_len or (None if args.dataset_path else output_len),
                                               args.dataset_path, seed)
        result = offline.run_throughput(llm, requests)
    llm.close()
    return _finish(args, result)


def _finish(args: argparse.Namespace, result: dict) -> int:
    """Write --output-json: the benchmark, the environment, the settings given, the figures."""
    if args.output_json:
        from nanoserve.bench.common import environment, write_json

        skip = ("command", "bench_command", "output_json", "default_output_len")
        settings = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
        path = write_json(args.output_json, {"benchmark": args.bench_command, **environment(), "settings": settings,
                                             **result})
        print(f"wrote {path}")
    return 0


def _graphs(args: argparse.Namespace, engine_options: dict) -> int:
    from nanoserve.bench.graphs import format_report, plot_reports, run_graphs_report

    if args.context < 1 or args.iters < 1 or args.warmup < 0:
        raise ValueError("--context and --iters must be positive, --warmup not negative")
    report = run_graphs_report(args.model, engine_options, distribution=args.distribution, context=args.context,
                               warmup=args.warmup, iters=args.iters,
                               log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {plot_reports([report], args.png)}")
    return 0


__all__ = ["add_bench_parser", "run_bench"]
