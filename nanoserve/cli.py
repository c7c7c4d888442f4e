"""Command line: nanoserve serve | generate | bench | make-tiny-model.

Engine options are derived from EngineConfig's fields, so every option has exactly one flag
(--max-num-seqs, --enforce-eager, …) and the CLI can never drift from the config.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from nanoserve.config import EngineConfig

_ENGINE_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for f in _ENGINE_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        if f.default is False:
            group.add_argument(flag, action="store_true", default=None)
        elif f.name == "cudagraph_capture_sizes":
            group.add_argument(flag, type=int, nargs="+", default=None, metavar="N")
        elif "int" in str(f.type):
            group.add_argument(flag, type=int, default=None)
        elif "float" in str(f.type):
            group.add_argument(flag, type=float, default=None)
        elif "bool" in str(f.type):
            group.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None, metavar="BOOL")
        else:
            group.add_argument(flag, type=str, default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    options = {f.name: getattr(args, f.name) for f in _ENGINE_FIELDS if getattr(args, f.name) is not None}
    return EngineConfig.from_kwargs(args.model, **options)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept `chat_template` in chat requests (rendered in a sandbox process, time-limited)")
    _add_engine_flags(serve)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    _add_engine_flags(gen)

    bench = sub.add_parser("bench", help="offline throughput: random token prompts, fixed output length")
    bench.add_argument("--model", required=True)
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=128)
    _add_engine_flags(bench)

    tiny = sub.add_parser("make-tiny-model", help="write a small random model folder (no download needed)")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], default="qwen3")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


def _cmd_generate(args) -> int:
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
    import random

    from nanoserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    print(json.dumps({"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                      "seconds": round(seconds, 3), "output_tokens_per_s": round(generated / seconds, 1),
                      "total_tokens_per_s": round((generated + args.num_prompts * args.input_len) / seconds, 1)}))
    return 0


def _cmd_serve(args) -> int:
    from nanoserve.server.app import serve

    return serve(engine_config_from_args(args), host=args.host, port=args.port, api_key=args.api_key,
                 served_model_name=args.served_model_name, trust_request_chat_template=args.trust_request_chat_template)


def _cmd_make_tiny_model(args) -> int:
    from nanoserve.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} model to {path}")
    print(f"try: nanoserve generate --model {path} --prompt 'Hello' --max-tokens 16")
    return 0


def _engine_options(args) -> dict:
    return {f.name: getattr(args, f.name) for f in _ENGINE_FIELDS if getattr(args, f.name) is not None}


_COMMANDS = {"serve": _cmd_serve, "generate": _cmd_generate, "bench": _cmd_bench, "make-tiny-model": _cmd_make_tiny_model}
