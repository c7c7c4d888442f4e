"""Tensor-parallel decode latency: CUDA-graph replay of one decode step at tp=1 vs tp=2 (issue 12's targets).

On the Llama-3.1-8B shape (random bf16 weights, load_format="dummy", context 512 per row) and b = 1, 64:

  * replay_ms: `steps` decode steps queued back to back (model_runner.decode_logits, graph replay), timed
    with CUDA events on rank 0 and divided by `steps`, median of `repeats` runs. Every rank replays the
    same bucket; rank 0's stream waits in each all-reduce for rank 1, so this is the group's step time.
    Back to back, as a serving loop runs with async scheduling: the host (and the pipe message to rank 1)
    runs ahead of the device;
  * synced_ms: one call between two synchronizes (what benchmarks/decode_latency.py reports), which adds
    the host's launch and, at tp=2, rank 1's message latency;
  * graph_vs_eager: max |Δ logit| of the replay against the eager forward on the same inputs;
  * the ratio tp=2 / tp=1 of replay_ms against the targets (b=1 ≤ 0.62, b=64 ≤ 0.65).

    python benchmarks/tp_latency.py --out benchmarks/results        # → <out>/tp_latency.json

Needs 2 GPUs. NCCL runs with the machine's settings (NVLink multicast stays off on the H200 machines).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import (  # noqa: E402
    MODEL_CONFIGS,
    RESULTS_DIR,
    env_info,
    kv_blocks_needed,
    model_config,
    release_cuda_memory,
    summarize_ms,
    time_ms,
    write_json,
    write_model_dir,
)

TARGETS = {1: 0.62, 64: 0.65}  # tp=2 replay ms / tp=1 replay ms, issue 12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2], help="tensor_parallel_size values (default 1 2)")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache per row")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=50, help="decode steps queued back to back per timing")
    p.add_argument("--repeats", type=int, default=7, help="timings per point (median reported)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output folder (default {RESULTS_DIR})")
    args = p.parse_args(argv)
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def build(model_dir: Path, tp: int, args: argparse.Namespace):
    from nanoserve import LLM

    blocks = kv_blocks_needed(args.batch_sizes[-1], args.context + 1, 16, spare=2)
    return LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
               tensor_parallel_size=tp, max_num_seqs=args.batch_sizes[-1], block_size=16,
               max_model_len=max(1024, args.context + 16), num_kv_blocks=max(blocks, 1024 // 16 + 1),
               cudagraph_capture_sizes=list(args.batch_sizes), enable_prefix_caching=False, show_progress=False)


def pipelined_ms(runner, batch, steps: int) -> float:
    """ms per step of `steps` replays queued back to back (CUDA events on rank 0's stream)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.decode_logits(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


@torch.inference_mode()
def measure_point(runner, b: int, args: argparse.Namespace) -> dict:
    rec: dict = {"batch_size": b}
    try:
        batch = runner.dummy_decode_batch(b, args.context)
        pipelined_ms(runner, batch, 10)  # warm-up
        runs = [pipelined_ms(runner, batch, args.steps) for _ in range(args.repeats)]
        rec["replay_ms"], rec["replay_runs_ms"] = statistics.median(runs), runs
        synced = summarize_ms(time_ms(lambda: runner.decode_logits(batch), "cuda", 5, 30))
        rec["synced_ms"], rec["synced_stats"] = synced["median"], synced
        ref = runner.decode_logits(batch, use_graph=False).float()
        torch.cuda.synchronize()
        out = runner.decode_logits(batch).float()
        torch.cuda.synchronize()
        rec["graph_vs_eager_max_abs"] = (out - ref).abs().max().item()
        rec["graph_vs_eager_argmax_agree"] = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    except Exception as error:  # one bad point must not lose the others
        rec["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return rec


def measure_tp(model_dir: Path, tp: int, args: argparse.Namespace) -> dict:
    result: dict = {"tensor_parallel_size": tp, "points": []}
    llm = runner = None
    try:
        t0 = time.perf_counter()
        llm = build(model_dir, tp, args)
        result["startup_seconds"] = time.perf_counter() - t0
        runner = llm.engine.core.runner
        gr = runner.graph_runner
        result["capture"] = None if gr is None else {"sizes": list(gr.capture_sizes), "seconds": gr.capture_seconds,
                                                     "pool_mib_rank0": gr.pool_bytes / 2**20}
        result["kv_blocks"] = runner.num_kv_blocks
        result["allocated_gib_rank0"] = torch.cuda.memory_allocated() / 2**30
        for b in args.batch_sizes:
            rec = measure_point(runner, b, args)
            result["points"].append(rec)
            print(f"tp={tp} b={b:<3} replay {rec.get('replay_ms', math.nan):7.3f} ms   synced "
                  f"{rec.get('synced_ms', math.nan):7.3f} ms   graph-eager max |Δ| "
                  f"{rec.get('graph_vs_eager_max_abs', math.nan):.3g}   {rec.get('error', '')}", flush=True)
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    finally:
        if llm is not None:
            llm.close()
        runner = llm = None  # noqa: F841 — drop every reference before freeing the memory
        release_cuda_memory()
    return result


def ratios(runs: list[dict]) -> dict:
    """replay_ms of each tp over tp=1's, per batch size, with the target and whether it is met."""
    by_tp = {r["tensor_parallel_size"]: {p["batch_size"]: p.get("replay_ms") for p in r["points"]} for r in runs}
    base = by_tp.get(1, {})
    out = {}
    for tp, points in by_tp.items():
        if tp == 1:
            continue
        for b, ms in points.items():
            ratio = ms / base[b] if ms and base.get(b) else None
            target = TARGETS.get(b) if tp == 2 else None
            out[f"tp{tp}_b{b}"] = {"ratio": ratio, "target": target,
                                   "met": None if ratio is None or target is None else ratio <= target}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.device_count() < max(args.tp):
        print(f"tp_latency: needs {max(args.tp)} GPUs, {torch.cuda.device_count()} visible")
        return 1
    report = {"benchmark": "tp_latency", "env": env_info(),
              "settings": {"model": args.model, "batch_sizes": args.batch_sizes, "tp": args.tp,
                           "context": args.context, "dtype": args.dtype, "steps": args.steps,
                           "repeats": args.repeats,
                           "timing": "replay_ms: steps back to back / steps, CUDA events on rank 0, median of "
                                     "repeats; synced_ms: one call between synchronizes, median of 30"},
              "targets": {f"b{b}": t for b, t in TARGETS.items()}, "runs": []}
    out_json = args.out / "tp_latency.json"
    with tempfile.TemporaryDirectory(prefix="nanoserve-tp-") as tmp:
        model_dir = write_model_dir(model_config(args.model), tmp)
        for tp in args.tp:
            report["runs"].append(measure_tp(model_dir, tp, args))
            report["ratios"] = ratios(report["runs"])
            write_json(out_json, report)  # after every engine, so a later crash keeps what was measured
    for key, r in report["ratios"].items():
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{key}: tp/tp1 replay {ratio} (target ≤ {r['target']}, met: {r['met']})")
    print(f"wrote {out_json}")
    return 0 if all("error" not in r for r in report["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
