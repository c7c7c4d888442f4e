"""Decode latency on real model shapes: ms per decode step, eager vs CUDA-graph replay vs the HBM floor.

For each model (random bf16 weights from a real config.json, load_format="dummy") and batch size b:

  * eager / graph: model_runner.decode_logits on model_runner.dummy_decode_batch(b, context) —
    the forward + logits of one decode step, nothing else; CUDA-event timed, median after warm-up;
  * floor: the minimum bytes a step must read (weights once, lm_head whole, b embedding rows,
    K/V of b × context tokens) ÷ the device-to-device copy bandwidth measured in this run;
  * e2e (a few b): engine.step() on b running requests with context-token prompts, after their
    prefill — adds scheduling, input building, sampling and output processing;
  * capture seconds and graph-pool MiB from model_runner.graph_runner.

Writes <out>/decode_latency.json (environment, settings, every number) and <out>/decode_latency.png
(decode_latency_fp8.* with --quantization fp8).

    python benchmarks/decode_latency.py                      # the three shapes, b = 1 … 256, context 512
    python benchmarks/decode_latency.py --models qwen3-0.6b --batch-sizes 1 8 64
    python benchmarks/decode_latency.py --quantization fp8        # fp8 weights (W8A16); the floor counts 1 byte each
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import (  # noqa: E402
    DTYPE_BYTES,
    MODEL_CONFIGS,
    RESULTS_DIR,
    decode_bytes,
    env_info,
    fit_batch_sizes,
    kv_bytes_per_token,
    measure_copy_bandwidth,
    model_config,
    param_counts,
    power_of_two_sizes,
    release_cuda_memory,
    summarize_ms,
    synchronize,
    time_ms,
    write_json,
    write_model_dir,
)

DEFAULT_MODELS = ["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m"]
DEFAULT_BATCH_SIZES = power_of_two_sizes(256)
DEFAULT_E2E_BATCH_SIZES = [1, 8, 64, 256]
E2E_WARMUP_STEPS = 3
E2E_EXTRA_TOKENS = 8  # max_tokens beyond the timed steps, so no request finishes while timed
E2E_RUNS = 3  # timed runs of e2e_steps consecutive steps (median reported)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="ms per decode step, eager vs CUDA-graph replay vs HBM floor, on real model shapes "
        "with random weights; writes JSON + PNG.",
    )
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(MODEL_CONFIGS),
                   help=f"model shapes to build (default: {' '.join(DEFAULT_MODELS)})")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=DEFAULT_BATCH_SIZES,
                   help="decode rows per step; each gets its own graph (default: 1 2 4 … 256)")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache per row (default 512)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="weights/KV dtype")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="store the linear layers' weights in fp8 (EngineConfig.quantization)")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the lm_head too")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each measurement")
    p.add_argument("--iters", type=int, default=30, help="timed calls per measurement (median reported)")
    p.add_argument("--e2e-batch-sizes", nargs="*", type=int, default=DEFAULT_E2E_BATCH_SIZES,
                   help="batch sizes for the engine.step() figure (those ≤ the largest --batch-sizes; "
                   "none: skip)")
    p.add_argument("--e2e-steps", type=int, default=10, help="timed engine.step() calls per e2e batch size")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--no-plot", action="store_true", help="write only the JSON")
    args = p.parse_args(argv)
    for name in ("context", "warmup", "iters", "e2e_steps", "block_size"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive")
    if any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes must be positive, got {args.batch_sizes}")
    args.batch_sizes = sorted(set(args.batch_sizes))
    args.e2e_batch_sizes = sorted({b for b in args.e2e_batch_sizes if 1 <= b <= args.batch_sizes[-1]})
    if args.quantize_lm_head and not args.quantization:
        p.error("--quantize-lm-head needs --quantization")
    return args


def kv_tokens_per_seq(context: int, e2e_steps: int) -> int:
    """Cache tokens one row may hold: the dummy batches use `context`; an e2e request grows to
    context + its generated tokens."""
    return context + E2E_WARMUP_STEPS + E2E_RUNS * e2e_steps + E2E_EXTRA_TOKENS + 1


def engine_max_model_len(cfg: dict, tokens_per_seq: int, block_size: int) -> int:
    """At least 1024 (a modest block-table width), at least one row's tokens, at most the model's limit."""
    return min(max(1024, math.ceil(tokens_per_seq / block_size) * block_size), cfg["max_position_embeddings"])


def build_llm(model_dir: Path, cfg: dict, batch_sizes: list[int], max_model_len: int, num_blocks: int,
              args: argparse.Namespace):
    from nanoserve import LLM

    return LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_num_seqs=batch_sizes[-1],
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        cudagraph_capture_sizes=list(batch_sizes),
        enable_prefix_caching=False,
        show_progress=False,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
    )


def check_quantized(llm, args: argparse.Namespace) -> None:
    """With --quantization the engine's model must hold fp8 weights (the runner passes the option to the loader)."""
    if not args.quantization:
        return
    weight = llm.engine.core.runner.model.model.layers[0].mlp.down_proj.weight
    if weight.dtype != torch.float8_e4m3fn:
        raise RuntimeError(f"--quantization {args.quantization} was given but the engine's weights are {weight.dtype}: "
                           "ModelRunner must pass config.quantization / quantize_lm_head to load_model")


def floor_bytes(cfg: dict, b: int, args: argparse.Namespace):
    """The step's minimum bytes: fp8 projections (and lm_head) read 1 byte a weight."""
    fp8_bytes = 1 if args.quantization else None
    return decode_bytes(cfg, b, args.context, DTYPE_BYTES[args.dtype], fp8_bytes,
                        1 if args.quantize_lm_head else None)


def measure_decode(runner, cfg: dict, b: int, args: argparse.Namespace, bandwidth: float) -> dict:
    """One (model, b) point; failures are recorded in the row, never raised."""
    floor = floor_bytes(cfg, b, args)
    rec: dict = {
        "batch_size": b,
        "context": args.context,
        "floor_bytes": dataclasses.asdict(floor) | {"total": floor.total},
        "floor_ms": floor.total / bandwidth * 1e3,
    }
    device = runner.device
    try:
        batch = runner.dummy_decode_batch(b, args.context)
        with torch.inference_mode():
            eager = summarize_ms(time_ms(lambda: runner.decode_logits(batch, use_graph=False), device,
                                         args.warmup, args.iters))
            rec["eager_ms"], rec["eager_stats"] = eager["median"], eager
            if runner.graph_runner is not None:
                graph = summarize_ms(time_ms(lambda: runner.decode_logits(batch, use_graph=True), device,
                                             args.warmup, args.iters))
                rec["graph_ms"], rec["graph_stats"] = graph["median"], graph
                rec["speedup"] = eager["median"] / graph["median"]
                # Same inputs, same cache: replay must reproduce the eager logits (bf16 tolerance).
                # Synchronise between calls: both stage inputs through one pinned host buffer.
                ref = runner.decode_logits(batch, use_graph=False).float()
                synchronize(device)
                out = runner.decode_logits(batch, use_graph=True).float()
                synchronize(device)
                rec["max_abs_logit_diff"] = (out - ref).abs().max().item()
                rec["argmax_agree"] = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
                del ref, out
        for key in ("eager", "graph"):
            if f"{key}_ms" in rec:
                rec[f"{key}_tokens_per_s"] = b / rec[f"{key}_ms"] * 1e3
        rec["floor_fraction"] = rec["floor_ms"] / rec["graph_ms"] if "graph_ms" in rec else None
    except Exception as error:  # one bad point must not lose the others
        rec["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return rec


def measure_e2e(llm, cfg: dict, b: int, args: argparse.Namespace) -> dict:
    """engine.step() with b running requests after their prefill: the whole decode step."""
    from nanoserve import SamplingParams

    engine = llm.engine
    device = engine.core.runner.device
    rec: dict = {"batch_size": b, "prompt_tokens": args.context}
    ids = [f"e2e-{b}-{i}" for i in range(b)]
    try:
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=E2E_WARMUP_STEPS + E2E_RUNS * args.e2e_steps + E2E_EXTRA_TOKENS)
        gen = torch.Generator().manual_seed(1000 + b)
        for rid in ids:  # distinct random prompts: no prefix-cache sharing
            prompt = torch.randint(0, cfg["vocab_size"], (args.context,), generator=gen).tolist()
            engine.add_request(rid, prompt, params)
        t0 = time.perf_counter()
        prefill_steps = 0
        scheduler = engine.core.scheduler  # until every prompt is prefilled (chunked prefill takes several steps)
        while scheduler.waiting or not all(s.decoding for s in scheduler.running):
            engine.step()
            prefill_steps += 1
            if prefill_steps > 4 * b + 16:
                raise RuntimeError(f"{engine.stats.num_waiting} requests still waiting after {prefill_steps} steps")
        synchronize(device)
        rec["prefill_seconds"], rec["prefill_steps"] = time.perf_counter() - t0, prefill_steps
        for _ in range(E2E_WARMUP_STEPS):
            engine.step()
        graph_steps_before = engine.stats.decode_steps_graph
        # Steps back to back, as a serving loop runs them: with async scheduling the host prepares step N+1
        # while the device runs step N, so only the whole run is timed (a sync per step would serialise them).
        samples, running = [], []
        for _ in range(E2E_RUNS):
            synchronize(device)
            t = time.perf_counter()
            for _ in range(args.e2e_steps):
                running.append(engine.stats.num_running)
                engine.step()
            synchronize(device)
            samples.append((time.perf_counter() - t) * 1e3 / args.e2e_steps)
        stats = summarize_ms(samples)
        rec.update(step_ms=stats["median"], step_stats=stats, tokens_per_s=b / stats["median"] * 1e3,
                   rows_per_step=sorted(set(running)),
                   graph_steps=engine.stats.decode_steps_graph - graph_steps_before)
        if rec["rows_per_step"] != [b]:
            rec["warning"] = f"expected {b} running rows every timed step, saw {rec['rows_per_step']}"
    except Exception as error:
        rec["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    finally:
        for rid in ids:
            try:
                engine.abort_request(rid)
            except Exception:
                traceback.print_exc()
    return rec


def measure_model(name: str, args: argparse.Namespace, bandwidth: float) -> dict:
    cfg = model_config(name)
    dtype_bytes = DTYPE_BYTES[args.dtype]
    result: dict = {"model": name, "config": cfg, "params": dataclasses.asdict(param_counts(cfg)),
                    "decode": [], "e2e": []}
    result["params"]["total"] = param_counts(cfg).total
    tokens = kv_tokens_per_seq(args.context, args.e2e_steps)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 1 << 50  # the fit check is for GPUs
    sizes, blocks = fit_batch_sizes(cfg, args.batch_sizes, tokens, args.block_size, free, dtype_bytes)
    skipped = [b for b in args.batch_sizes if b not in sizes]
    if skipped:
        result["skipped_batch_sizes"] = skipped
        print(f"[{name}] not enough free memory ({free / 2**30:.1f} GiB) for batch sizes {skipped}; skipped")
    if not sizes:
        result["error"] = "weights + KV for batch size 1 do not fit in free GPU memory"
        return result
    max_model_len = engine_max_model_len(cfg, tokens, args.block_size)
    if tokens > max_model_len:
        result["error"] = f"context {args.context} + generated tokens exceed max_position_embeddings {max_model_len}"
        return result
    blocks = max(blocks, math.ceil(max_model_len / args.block_size))  # the engine wants one whole row to fit
    result["max_model_len"] = max_model_len
    result["kv_blocks_requested"] = blocks
    result["kv_gib"] = blocks * args.block_size * kv_bytes_per_token(cfg, dtype_bytes) / 2**30
    llm = runner = None
    with tempfile.TemporaryDirectory(prefix=f"nanoserve-{name}-") as tmp:
        try:
            model_dir = write_model_dir(cfg, tmp)
            t0 = time.perf_counter()
            llm = build_llm(model_dir, cfg, sizes, max_model_len, blocks, args)
            check_quantized(llm, args)
            result["startup_seconds"] = time.perf_counter() - t0
            runner = llm.engine.core.runner
            gr = runner.graph_runner
            result["capture"] = None if gr is None else {
                "sizes": list(gr.capture_sizes),
                "seconds": gr.capture_seconds,
                "pool_mib": gr.pool_bytes / 2**20,
            }
            result["kv_blocks_total"] = llm.engine.stats.kv_blocks_total
            result["allocated_gib_after_start"] = _allocated_gib()
            print_model_header(result)
            for b in sizes:
                rec = measure_decode(runner, cfg, b, args, bandwidth)
                result["decode"].append(rec)
                print_decode_row(rec)
            replay = {r["batch_size"]: r.get("graph_ms") for r in result["decode"]}
            for b in [b for b in args.e2e_batch_sizes if b <= sizes[-1]]:
                rec = measure_e2e(llm, cfg, b, args)
                if rec.get("step_ms") and replay.get(b):  # the issue's target: ≤ 1.05
                    rec["step_over_replay"] = rec["step_ms"] / replay[b]
                result["e2e"].append(rec)
                print_e2e_row(rec)
        except Exception as error:
            result["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        finally:
            gr = runner = llm = None  # noqa: F841 — drop every reference before freeing the memory
            release_cuda_memory()
    result["allocated_gib_after_free"] = _allocated_gib()
    return result


def _allocated_gib() -> float | None:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


def print_model_header(result: dict) -> None:
    cap = result.get("capture")
    cap_text = "no graphs" if cap is None else (
        f"{len(cap['sizes'])} graphs in {cap['seconds']:.1f} s, pool {cap['pool_mib']:.0f} MiB")
    print(f"\n== {result['model']}: {result['params']['total'] / 1e9:.2f} B params, start-up "
          f"{result['startup_seconds']:.1f} s, {cap_text}, KV {result['kv_blocks_total']} blocks "
          f"({result['kv_gib']:.1f} GiB)")
    print(f"{'b':>5} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'speed-up':>9} {'graph tok/s':>12} "
          f"{'floor/graph':>11} {'argmax==':>9}")


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_decode_row(rec: dict) -> None:
    if "error" in rec:
        print(f"{rec['batch_size']:>5} error: {rec['error']}")
        return
    print(f"{rec['batch_size']:>5} {_fmt(rec.get('eager_ms'), '9.3f')} {_fmt(rec.get('graph_ms'), '9.3f'):>9} "
          f"{rec['floor_ms']:9.3f} {_fmt(rec.get('speedup'), '8.2f'):>8}x "
          f"{_fmt(rec.get('graph_tokens_per_s'), '12.0f'):>12} "
          f"{_fmt(rec.get('floor_fraction'), '11.2f'):>11} {_fmt(rec.get('argmax_agree'), '9.3f'):>9}", flush=True)


def print_e2e_row(rec: dict) -> None:
    if "error" in rec:
        print(f"  e2e b={rec['batch_size']}: error: {rec['error']}")
        return
    warn = f"  ({rec['warning']})" if "warning" in rec else ""
    ratio = f", {rec['step_over_replay']:.3f}× replay" if "step_over_replay" in rec else ""
    print(f"  e2e b={rec['batch_size']:<4} engine.step() {rec['step_ms']:8.3f} ms{ratio}, {rec['tokens_per_s']:9.0f} "
          f"tok/s, {rec['graph_steps']} steps on graphs, prefill {rec['prefill_seconds']:.2f} s{warn}", flush=True)


def plot(report: dict, path: Path) -> Path | None:
    """ms/step vs batch size, one panel per model: eager, graph replay, HBM floor, engine.step()."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in report["models"] if any("eager_ms" in r for r in m.get("decode", []))]
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        ok = [r for r in m["decode"] if "eager_ms" in r]
        bs = [r["batch_size"] for r in ok]
        ax.plot(bs, [r["eager_ms"] for r in ok], "o-", label="eager forward")
        g = [r for r in ok if "graph_ms" in r]
        if g:
            ax.plot([r["batch_size"] for r in g], [r["graph_ms"] for r in g], "o-", label="CUDA graph replay")
        ax.plot(bs, [r["floor_ms"] for r in ok], "k--", label="HBM floor")
        e2e = [r for r in m.get("e2e", []) if "step_ms" in r]
        if e2e:
            ax.plot([r["batch_size"] for r in e2e], [r["step_ms"] for r in e2e], "s", ms=8,
                    label="engine.step(): + scheduling, sampling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("decode batch size (rows)")
        ax.set_ylabel("ms per decode step")
        weights = report["settings"].get("quantization") or report["settings"]["dtype"]
        ax.set_title(f"{m['model']} — random {weights} weights, context "
                     f"{report['settings']['context']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    env = report["env"]
    fig.suptitle(f"{env.get('gpu') or 'unknown GPU'} · torch {env.get('torch')} · {env.get('date', '')[:10]}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_latency: CUDA is not available; this benchmark times GPU decode steps and needs a GPU.")
        return 1
    start = time.perf_counter()
    env = env_info()
    bandwidth = max(measure_copy_bandwidth("cuda") for _ in range(3))
    print(f"{env['gpu']}, torch {env['torch']}; device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    report: dict = {
        "benchmark": "decode_latency",
        "env": env,
        "settings": {
            "models": args.models, "batch_sizes": args.batch_sizes, "context": args.context, "dtype": args.dtype,
            "quantization": args.quantization, "quantize_lm_head": args.quantize_lm_head,
            "warmup": args.warmup, "iters": args.iters, "e2e_batch_sizes": args.e2e_batch_sizes,
            "e2e_steps": args.e2e_steps, "block_size": args.block_size,
            "timing": "CUDA events around one call after a synchronize; median of iters after warmup",
            "floor": "weights once (lm_head whole, embedding b rows; tied counted once) + K/V of b*context "
                     "tokens, divided by the measured copy bandwidth",
        },
        "copy_bandwidth_bytes_per_s": bandwidth,
        "models": [],
    }
    stem = "decode_latency" + (f"_{args.quantization}" if args.quantization else "")
    out_json = args.out / f"{stem}.json"
    for name in args.models:
        report["models"].append(measure_model(name, args, bandwidth))
        report["total_seconds"] = time.perf_counter() - start
        write_json(out_json, report)  # after every model, so a later crash keeps what was measured
    print(f"\nwrote {out_json}")
    if not args.no_plot:
        try:
            png = plot(report, args.out / f"{stem}.png")
            print(f"wrote {png}" if png else "no successful measurement to plot")
        except Exception:
            traceback.print_exc()
    print(f"total {report['total_seconds']:.0f} s")
    failed = [m["model"] for m in report["models"] if "error" in m]
    return 1 if failed and len(failed) == len(report["models"]) else 0


if __name__ == "__main__":
    sys.exit(main())
