"""Command line: nanoserve serve | generate | bench latency|throughput|serve|graphs | make-tiny-model.

Engine options are derived from EngineConfig's fields, so every option has exactly one flag
(--max-num-seqs, --enforce-eager, …) and the CLI can never drift from the config. Nothing heavy (torch,
transformers, the server) is imported before a command runs: --version, --help and argument errors answer
at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys

from nanoserve import __version__
from nanoserve.config import (FIELD_HELP, LOG_STATS_INTERVAL_S, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS,
                              REQUEST_BODY_TIMEOUT_S, SERVE_DEFAULTS, SHUTDOWN_TIMEOUT_S, TOOL_CALL_PARSER_CHOICES,
                              EngineConfig)
from nanoserve.tiny import ALL_ARCHS

_ENGINE_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


def parse_bool(text: str) -> bool:
    """true/yes/1 or false/no/0, any case; anything else is an error (a typo must not flip an option)."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise argparse.ArgumentTypeError(f"expected true/false, yes/no or 1/0, got {text!r}")
_ALIASES = {"tensor_parallel_size": ["-tp"]}  # vLLM's short flag


def _add_engine_flags(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One flag per EngineConfig field, its help the field's own. defaults: a command's own defaults for some fields
    (serve's), shown in its --help; a flag left out passes None, so EngineConfig's default (or the command's) applies."""
    group = parser.add_argument_group("engine options")
    for f in _ENGINE_FIELDS:
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        text = f.metadata["help"] + _default_shown(f, (defaults or {}).get(f.name, f.default))
        if "bool" in str(f.type):  # `--flag` alone means true
            group.add_argument(*flags, type=parse_bool, nargs="?", const=True, default=None, metavar="BOOL", help=text)
        elif f.name == "cudagraph_capture_sizes":  # auto | pow2 | N N ...: EngineConfig checks the words
            group.add_argument(*flags, nargs="+", default=None, metavar="auto|pow2|N", help=text)
        elif f.name == "prefill_graph_sizes":
            group.add_argument(*flags, nargs="+", default=None, metavar="auto|off|N", help=text)
        elif "int" in str(f.type):
            group.add_argument(*flags, type=int, default=None, metavar="N", help=text)
        elif "float" in str(f.type):
            group.add_argument(*flags, type=float, default=None, metavar="X", help=text)
        else:
            group.add_argument(*flags, type=str, default=None, help=text)
    parser.set_defaults(**(defaults or {}))


def _default_shown(f: dataclasses.Field, default) -> str:
    """" (default: X)": the value the command uses, or for None what the field says None stands for."""
    if default is None:
        return f" (default: {f.metadata['unset']})" if f.metadata["unset"] else ""
    return f" (default: {str(default).lower() if isinstance(default, bool) else default})"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(args.model, **_engine_options(args))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"nanoserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_generate, _add_bench, _add_make_tiny_model, _add_models):
        add(sub)
    return parser


def _add_serve(sub) -> None:
    """`nanoserve serve`: the server's own options, then the engine's."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", usage="nanoserve serve MODEL [options]")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the same as --model")
    serve.add_argument("--model", default=None, help=FIELD_HELP["model"])
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version, /metrics")
    serve.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="origins (http://host:port, or *) whose web pages may call this server through a browser "
                            "(CORS); also vLLM's JSON list form '[\"http://a\"]'. Default: none, a cross-origin "
                            "request is answered 403")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name the API reports and accepts; default: the --model path as given")
    serve.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="the chat template to render chat prompts with (a file, or the Jinja text), instead of "
                            "the tokenizer's")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept `chat_template` in chat requests (rendered in a sandbox process, time-limited)")
    serve.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long requests in flight may finish; streams still open then end "
                            "with an error event (0: at once; a second signal also ends them; default: %(default)s)")
    serve.add_argument("--request-body-timeout", type=float, default=REQUEST_BODY_TIMEOUT_S, metavar="SECONDS",
                       help="a request body not received in full this long after the request started is answered "
                            "408 and its connection closed (default: %(default)s)")
    serve.add_argument("--max-stop-strings", type=int, default=MAX_STOP_STRINGS, metavar="N",
                       help="most stop strings one request may give; more are answered 400 (default: %(default)s)")
    serve.add_argument("--max-stop-string-len", type=int, default=MAX_STOP_STRING_LEN, metavar="N",
                       help="longest stop string, in characters; longer ones are answered 400 (default: %(default)s)")
    serve.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSER_CHOICES,
                       help="how tool_choice \"auto\" outputs become tool_calls: auto (the format the chat template "
                            "asks for: <tool_call> → hermes, Llama 3.1's JSON → llama3_json), none (left as content), "
                            "or a parser (default: %(default)s)")
    serve.add_argument("--responses-store-bytes", type=int, default=64 * 2**20, metavar="BYTES",
                       help="memory for the conversations of /v1/responses answers, read by previous_response_id; "
                            "the oldest go first (0: none kept; default: %(default)s)")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic stats lines (throughput, requests, KV cache, prefix hits, speculation; every "
                            f"{LOG_STATS_INTERVAL_S:g} s while the engine works)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM command lines: tool_choice \"auto\" is always on here")
    _add_engine_flags(serve, SERVE_DEFAULTS)


def _add_generate(sub) -> None:
    """`nanoserve generate`."""
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", required=True, help=FIELD_HELP["model"])
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0: all "
                     "(default: %(default)s)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    _add_engine_flags(gen)


def _add_bench(sub) -> None:
    """`nanoserve bench latency | throughput | serve | graphs` (nanoserve/bench/cli.py)."""
    from nanoserve.bench.cli import add_bench_parser

    add_bench_parser(sub, _add_engine_flags)


def _add_make_tiny_model(sub) -> None:
    """`nanoserve make-tiny-model`."""
    tiny = sub.add_parser("make-tiny-model", help="write a small random model folder (no download needed)")
    tiny.add_argument("dir", help="folder to write (created if missing)")
    tiny.add_argument("--arch", choices=ALL_ARCHS, default="qwen3", help="(default: %(default)s)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")


def _add_models(sub) -> None:
    """`nanoserve models`."""
    sub.add_parser("models", help="the model architectures nanoserve runs (and the ones it refuses, and why)")


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _serve_model_argument(parser, args)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


def _resolved_config(args) -> EngineConfig:
    """The command's EngineConfig, its hub ids resolved and a missing model refused before torch and transformers
    are imported (seconds): a typo or an unreachable hub answers at once."""
    from nanoserve.hub import resolve_config

    return resolve_config(engine_config_from_args(args))


def _cmd_generate(args) -> int:
    config = _resolved_config(args)
    args.model, args.tokenizer = config.model, config.tokenizer
    from nanoserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed if args.temperature > 0 else None)
    if args.stream:
        for prompt in args.prompt:
            print(prompt, end="", flush=True)
            for delta in llm.stream(prompt, params):
                print(delta.text, end="", flush=True)
            print()
        return 0
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params, use_tqdm=False)):
        print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                          "num_tokens": len(out.token_ids)}, ensure_ascii=False))
    return 0


def _cmd_bench(args) -> int:
    from nanoserve.bench.cli import run_bench

    return run_bench(args, _engine_options(args))


def _serve_model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`nanoserve serve MODEL` (as `vllm serve MODEL`) or `--model MODEL`: exactly one of them."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag or args.model
    if args.model is None:
        parser.error("serve needs a model: nanoserve serve MODEL (a folder, a .gguf file or a hub id org/name)")


def _cmd_serve(args) -> int:
    engine_config_from_args(args)  # option errors before anything is imported or loaded
    check_port_free(args.host, args.port)  # before the model load: a busy port should not cost a minute
    config = _resolved_config(args)
    from nanoserve.server.app import serve

    # a hub id is served under its id, not its snapshot folder
    return serve(config, host=args.host, port=args.port, api_key=args.api_key,
                 served_model_name=args.served_model_name or args.model, trust_request_chat_template=args.trust_request_chat_template,
                 shutdown_timeout=args.shutdown_timeout, request_body_timeout=args.request_body_timeout,
                 max_stop_strings=args.max_stop_strings, max_stop_string_len=args.max_stop_string_len,
                 tool_call_parser=args.tool_call_parser, allowed_origins=args.allowed_origins,
                 chat_template=args.chat_template, responses_store_bytes=args.responses_store_bytes,
                 log_stats=not args.disable_log_stats)


def check_port_free(host: str, port: int) -> None:
    """ValueError naming host:port unless a listening socket can be bound there now (as uvicorn will bind it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn sets: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e}"
                             " (is another server running there? choose one with --host/--port)") from None


def _cmd_make_tiny_model(args) -> int:
    from nanoserve.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} model to {path}")
    print(f"try: nanoserve generate --model {path} --prompt 'Hello' --max-tokens 16")
    return 0


def _cmd_models(args) -> int:
    from nanoserve.model_files import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, SUPPORTED_GGUF_ARCHITECTURES

    print("Hugging Face folders (config.json architectures): " + ", ".join(SUPPORTED_ARCHITECTURES))
    print("GGUF files (general.architecture): " + ", ".join(SUPPORTED_GGUF_ARCHITECTURES))
    print("Refused, with what they need that nanoserve does not have:")
    for name, why in REFUSED_ARCHITECTURES.items():
        print(f"  {name}: {why}")
    return 0


def _engine_options(args) -> dict:
    return {f.name: getattr(args, f.name) for f in _ENGINE_FIELDS if getattr(args, f.name, None) is not None}


_COMMANDS = {"serve": _cmd_serve, "generate": _cmd_generate, "bench": _cmd_bench, "make-tiny-model": _cmd_make_tiny_model,
             "models": _cmd_models}
