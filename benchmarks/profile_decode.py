"""Where a decode step's GPU time goes, and what each kernel switch is worth.

    python benchmarks/profile_decode.py [--models qwen3-0.6b llama-3.1-8b smollm2-135m] [--batch-sizes 1 32]
                                        [--switch-sets all no_pdl ...] [--json PATH]

For each model (random bf16 weights, real shapes) the engine captures graphs for the given batch sizes
(context 512). Then, for each switch set (kernels/switches.py: PDL and each fusion on or off; see
SWITCH_SETS), the graphs are captured again under those switches and, per batch size:
  * replay_ms: median graph replay of one decode step (nanoserve.bench.decode_step, as `nanoserve bench graphs`);
  * kernels per step and GPU time per kernel kind (gemv, attention, attention merge, norm, rotary, lm_head,
    other), from torch.profiler over one replay: sum_us adds kernel durations (with PDL a kernel starts
    early and its duration includes its wait), busy_us gives each stretch of the timeline to the kernel
    that ends it, so the kinds' busy_us add up to the time the GPU was busy;
  * the graph's edges (benchmarks/graph_edges.py): with PDL on, every Triton kernel that follows a kernel
    must hang on a programmatic edge; a graph that lost them runs, only slower.
Writes one JSON (--json) and prints a summary table.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import traceback
from collections import defaultdict
from functools import partial
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (env_info, model_config, release_cuda_memory, write_json,  # noqa: E402
                               write_model_dir)
from nanoserve.kernels.switches import SWITCHES, switched  # noqa: E402

SWITCH_SETS: dict[str, dict[str, bool | int]] = {
    "all": {},  # the defaults (kernels/switches.py)
    "wide": {"fuse_max_m": 64},  # every fusion for up to 64 rows
    "no_pdl": {"pdl": False},
    "no_fuse_norm": {"fuse_norm": False},
    "no_fuse_silu": {"fuse_silu": False},
    "no_fuse_merge": {"fuse_merge": False},
    "none": {"pdl": False, "fuse_norm": False, "fuse_silu": False, "fuse_merge": False, "fuse_max_m": 0},
}
KINDS = ("gemv", "attention", "attention merge", "norm", "rotary", "lm_head", "other")
_NAMED_KINDS = {"_gemv_kernel": "gemv", "_decode_kernel": "attention", "_prefill_kernel": "attention",
                "_decode_reduce_kernel": "attention merge", "_rms_norm_kernel": "norm",
                "_qk_norm_rope_kernel": "rotary", "_store_kv_kernel": "rotary", "_silu_and_mul_kernel": "other"}
_CUBLAS_MARKERS = ("nvjet", "gemm", "gemv", "cutlass", "xmma", "splitkreduce", "cublas")


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name; matrix products of cuBLAS count as gemv (lm_head is found by position)."""
    if name in _NAMED_KINDS:
        return _NAMED_KINDS[name]
    lowered = name.lower()
    if "flash" in lowered:  # flash varlen attention (eager prompt steps)
        return "attention"
    return "gemv" if any(m in lowered for m in _CUBLAS_MARKERS) else "other"


def kind_table(kernels: list[tuple[str, float, float]]) -> dict:
    """kernels: (name, start_us, end_us) of one step. Per kind: count, sum_us, busy_us; the last product of the
    step is the lm_head. Also the step's kernel count, span and busy time, and the top kernels by name."""
    kernels = sorted(kernels, key=lambda k: k[1])
    kinds = [kernel_kind(n) for n, _, _ in kernels]
    products = [i for i, kind in enumerate(kinds) if kind == "gemv"]
    if products:
        kinds[products[-1]] = "lm_head"
    table = {kind: {"count": 0, "sum_us": 0.0, "busy_us": 0.0} for kind in KINDS}
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    covered = float("-inf")
    for (name, start, end), kind in zip(kernels, kinds):
        row = table[kind]
        row["count"] += 1
        row["sum_us"] += end - start
        row["busy_us"] += max(0.0, end - max(start, covered))
        covered = max(covered, end)
        by_name[name][0] += 1
        by_name[name][1] += end - start
    busy = sum(r["busy_us"] for r in table.values())
    span = kernels[-1][2] - kernels[0][1] if kernels else 0.0
    top = sorted(((n[:90], c, t) for n, (c, t) in by_name.items()), key=lambda r: -r[2])[:15]
    return {"kernels": len(kernels), "span_us": span, "busy_us": busy, "kinds": table, "top": top}


def profile_step(run) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every kernel of one call of run(), memory copies and sets left out."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not evt.name.startswith(("Memcpy", "Memset")):
            out.append((evt.name, float(evt.time_range.start), float(evt.time_range.end)))
    return out


@contextlib.contextmanager
def kept_graphs():
    """Graphs created meanwhile keep their cudaGraph_t (keep_graph=True), so their edges can be read."""
    make = torch.cuda.CUDAGraph
    try:
        make(keep_graph=True)
    except TypeError:  # an older torch: no edge check
        yield False
        return
    with mock.patch.object(torch.cuda, "CUDAGraph", lambda *a, **k: make(*a, **{**k, "keep_graph": True})):
        yield True


def graph_edges(graph_runner, sizes: list[int]) -> dict:
    from benchmarks.graph_edges import inspect_graph

    out = {}
    for b in sizes:
        try:
            graph = graph_runner.graphs[b]
            out[str(b)] = inspect_graph(graph.raw_cuda_graph()).as_dict()
        except Exception as exc:
            out[str(b)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def measure_bucket(runner, b: int, context: int) -> dict:
    """Replay time and GPU time by kernel kind of one decode step of b rows (nanoserve.bench.decode_step)."""
    from nanoserve.bench.decode_step import decode_batch, run_decode_step, time_decode_step

    batch = decode_batch(runner, b, context)
    rec: dict = {"replay_ms": sorted(time_decode_step(runner, batch, warmup=5, iters=50))[25]}
    kernels = profile_step(partial(run_decode_step, runner, batch))
    rec["profile_source"] = "graph replay"
    if not any(name in _NAMED_KINDS for name, _, _ in kernels):
        rec["profile_source"] = "graph replay (this profiler does not see into graphs: no kernel kinds)"
    rec.update(kind_table(kernels))
    return rec


def measure_switch_set(runner, name: str, sizes: list[int], context: int) -> dict:
    rec: dict = {"switches": {}, "buckets": {}}
    try:
        with switched(**SWITCH_SETS[name]), kept_graphs() as kept:
            rec["switches"] = dict(SWITCHES.__dict__)
            gr = runner.graph_runner  # recapture the same sizes under this switch set
            captured = gr.capture_sizes
            gr.drop(captured)
            gr.capture(captured)
            rec["capture_s"] = runner.graph_runner.capture_seconds
            rec["edges"] = graph_edges(runner.graph_runner, sizes) if kept else {"error": "torch has no keep_graph"}
            for b in sizes:
                rec["buckets"][str(b)] = measure_bucket(runner, b, context)
    except Exception as exc:  # one failing set must not lose the others
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    return rec


def measure_model(name: str, sizes: list[int], sets: list[str], context: int) -> dict:
    from nanoserve import LLM

    cfg = model_config(name)
    result: dict = {"sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(write_model_dir(cfg, tmp)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_num_seqs=max(sizes), max_model_len=1024, cudagraph_capture_sizes=sizes,
                  num_kv_blocks=max(sizes) * (context // 16 + 1) + 64, enable_prefix_caching=False,
                  show_progress=False)
        runner = llm.engine.core.runner
        for set_name in sets:
            result["sets"][set_name] = rec = measure_switch_set(runner, set_name, sizes, context)
            print_set(name, set_name, rec)
        del llm, runner
        release_cuda_memory()
    return result


def print_set(model: str, set_name: str, rec: dict) -> None:
    if "error" in rec:
        print(f"== {model} [{set_name}]: error {rec['error']}", flush=True)
        return
    for b, r in rec["buckets"].items():
        edges = rec.get("edges", {}).get(b, {})
        pdl = (f"{edges['programmatic_edges']} PDL edges, {edges['pdl_kernels_without_programmatic_edge']} missing"
               if "programmatic_edges" in edges else f"edges: {edges.get('error', '-')}")
        kinds = "  ".join(f"{k} {v['count']}x {v['busy_us']:.0f}" for k, v in r["kinds"].items() if v["count"])
        print(f"== {model} b={b} [{set_name}]: replay {r['replay_ms']:.3f} ms, {r['kernels']} kernels, busy "
              f"{r['busy_us'] / 1000:.3f} ms ({r['profile_source']}); {pdl}\n     busy µs: {kinds}", flush=True)


def summary_rows(report: dict) -> list[dict]:
    """One row per (model, b): replay ms per switch set, kernels per step (all vs none), checks."""
    rows = []
    for model, m in report["models"].items():
        sets = m.get("sets", {})
        sizes = sorted({int(b) for s in sets.values() for b in s.get("buckets", {})})
        for b in sizes:
            row = {"model": model, "b": b, "replay_ms": {}, "kernels": {}}
            for set_name, s in sets.items():
                r = s.get("buckets", {}).get(str(b))
                if r:
                    row["replay_ms"][set_name], row["kernels"][set_name] = r["replay_ms"], r["kernels"]
            all_set = sets.get("all", {})
            edges = all_set.get("edges", {}).get(str(b), {})
            row["pdl_edges_ok"] = bool(edges.get("programmatic_edges")) and not edges.get(
                "pdl_kernels_without_programmatic_edge") if "programmatic_edges" in edges else None
            rows.append(row)
    return rows


def print_summary(rows: list[dict], sets: list[str]) -> None:
    print("\nreplay ms per decode step (context 512) by switch set; kernels per step; checks")
    print(f"{'model':<14}{'b':>4} " + "".join(f"{s:>13}" for s in sets) + f"{'kernels':>12} {'PDL edges':>10}")
    for r in rows:
        cells = "".join(f"{r['replay_ms'][s]:13.3f}" if s in r["replay_ms"] else f"{'-':>13}" for s in sets)
        kernels = f"{r['kernels'].get('all', '-')}/{r['kernels'].get('none', '-')}"
        print(f"{r['model']:<14}{r['b']:>4} {cells}{kernels:>12} {str(r['pdl_edges_ok']):>10}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    p.add_argument("--switch-sets", nargs="+", default=list(SWITCH_SETS), choices=list(SWITCH_SETS))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_decode.py needs a CUDA GPU")
        return 0
    sizes = sorted(set(args.batch_sizes))
    report = {"env": env_info(), "settings": {"batch_sizes": sizes, "context": args.context,
                                              "switch_sets": {s: SWITCH_SETS[s] for s in args.switch_sets}},
              "models": {}}
    for name in args.models:
        try:
            report["models"][name] = measure_model(name, sizes, args.switch_sets, args.context)
        except Exception as exc:
            report["models"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
            release_cuda_memory()
        report["summary"] = summary_rows(report)
        if args.json:
            write_json(args.json, report)
    print_summary(report["summary"], args.switch_sets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
