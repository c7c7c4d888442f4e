"""GPU sweep of the few-row GEMV (nanoserve/kernels/gemv.py) against cuBLAS; prints the GEMV_TABLE to paste.

    python benchmarks/gemv.py OUT.json [--budget-s 170] [--m 1,2,4,8,16,32,64] [--models ...] [--fp8]

For the decode matrices (qkv, o_proj, gate_up, down, lm_head; bf16) of Qwen3-0.6B, Llama-3.1-8B and the
SmolLM2-135M shape, and M = 1, 2, 4, 8, 16, 32, 64 rows: correctness (max error relative to the largest
output, against an fp32 reference) of cuBLAS and every Triton variant, then the time per call of cuBLAS,
of the variant GEMV_TABLE picks now (with programmatic dependent launch on and off), and of every swept
variant (configs_for), the achieved TB/s and the best variant per (shape, M). From those it derives the
dispatch table (rows bucket → weight-size ranges → best shared variant, Triton or cuBLAS) and prints it as
Python for nanoserve/kernels/gemv.py. A few extra checks close the run (bias, odd N, fp16, split-K under
CUDA-graph replay).

Timing: for each variant, a CUDA graph of back-to-back calls is captured; the calls rotate through
copies of the weight that together hold >= 3x the L2 cache, so every call streams its weight
from HBM as in a real decode step. The graph is replayed (3 replays per sample, 7 samples) and
the time per call is the median sample / calls. It includes the launch gap between kernels in a
graph — what a decode step pays — and, with PDL, the overlap of consecutive Triton launches.

--fp8: the same sweep for float8_e4m3fn weights with per-channel scales (kernels/fp8.py), over tiles of the same
bytes (twice the K); the library baseline is then fp8.linear (torch._scaled_mm or dequantize + cuBLAS, what the
model would run without the kernel), the bf16 cuBLAS time is recorded beside it, and the table printed is
FP8_GEMV_TABLE.

Budget: all variants are compiled first, in parallel worker processes (Triton's on-disk cache then serves
them); the sweep shares what is left of --budget-s among the shapes and skips the variants it has no time
for (cuBLAS and the table's variant are always timed). Every variant is isolated: a failure is recorded
in the JSON and the run goes on; the JSON is rewritten after every shape.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import MODEL_CONFIGS, env_info, head_dim, write_json  # noqa: E402
from nanoserve.kernels import fp8, gemv  # noqa: E402
from nanoserve.kernels._triton import HAS_TRITON  # noqa: E402
from nanoserve.kernels.gemv import CUBLAS, TRITON, GemvConfig  # noqa: E402
from nanoserve.kernels.switches import switched  # noqa: E402

DTYPE = torch.bfloat16
ERR_OK = 1e-2  # max |out - ref| / max |ref|: bf16 rounding is ~4e-3
ERR_OK_W8A8 = 8e-2  # fp8 library baseline: _scaled_mm also rounds x to e4m3 (~2.6 % a value)
SAMPLES, REPLAYS_PER_SAMPLE, MIN_CALLS, MAX_COPIES = 7, 3, 20, 320
RESERVE_S = 15.0  # of --budget-s, kept for the last shape's fixed timings, the extra checks, the summary
WIN_MARGIN = 0.02  # Triton must beat cuBLAS by this fraction to take a plain product
SHARE_SLACK = 1.05  # shapes share a table entry when one variant is within this factor of each one's best
LAYERS = ("qkv", "o_proj", "gate_up", "down", "lm_head")

# -- the sweep: (block_n, block_k, num_warps, num_stages) per path, and split rules --------------------------
SWEEP_FMA_TILES = ((4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 2), (16, 512, 4, 3), (16, 256, 4, 4),
                   (32, 256, 8, 3))
SWEEP_DOT_TILES = ((16, 512, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 3),
                   (128, 128, 8, 3))
# fp8 weights: the same tiles in bytes (twice the K), and the bf16 tiles themselves
SWEEP_FMA_TILES_FP8 = ((4, 2048, 8, 3), (8, 1024, 4, 3), (8, 2048, 8, 2), (16, 1024, 4, 3), (16, 512, 4, 4),
                       (32, 512, 8, 3), (4, 1024, 4, 3), (8, 512, 4, 3))
SWEEP_DOT_TILES_FP8 = ((16, 1024, 4, 3), (32, 512, 4, 3), (64, 256, 4, 4), (64, 512, 4, 3), (64, 512, 8, 3),
                       (128, 256, 8, 3), (64, 128, 4, 4))
SWEEP_PROGRAMS_PER_SM = (0, 1, 2, 4)
SWEEP_FMA_MAX_M = 4  # the FMA path is swept up to this many rows, the dot path from 2 rows
H200_SMS = 132  # SM count assumed when no GPU says otherwise (tests of the sweep logic)


def sweep_configs(m: int, element_size: int = 2) -> list[GemvConfig]:
    """Every swept variant for m rows, before removing those that resolve to the same launch."""
    fma, dot = (SWEEP_FMA_TILES_FP8, SWEEP_DOT_TILES_FP8) if element_size == 1 else (SWEEP_FMA_TILES, SWEEP_DOT_TILES)
    paths = [(False, t) for t in fma] if m <= SWEEP_FMA_MAX_M else []
    paths += [(True, t) for t in dot] if m >= 2 else []
    return [GemvConfig(bn, bk, warps, stages, use_dot, per_sm)
            for use_dot, (bn, bk, warps, stages) in paths for per_sm in SWEEP_PROGRAMS_PER_SM]


def launch_key(config: GemvConfig, m: int, n: int, k: int, sms: int, element_size: int = 2) -> tuple:
    """Two configs with the same key run the same launch on this shape."""
    p = gemv.plan(config, m, n, k, sms, element_size, DTYPE.itemsize)
    return (p.use_dot, p.block_n, p.block_k, p.num_warps, p.num_stages, p.split_k)


def configs_for(m: int, n: int, k: int, sms: int = H200_SMS, element_size: int = 2) -> list[GemvConfig]:
    """The swept variants worth timing for one shape: one per distinct launch."""
    out, seen = [], set()
    for cfg in sweep_configs(m, element_size):
        key = launch_key(cfg, m, n, k, sms, element_size)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


@dataclass(frozen=True)
class Shape:
    model: str
    layer: str
    n: int
    k: int
    element_size: int = 2  # of the weight: 1 for fp8

    @property
    def name(self) -> str:
        return f"{self.model}/{self.layer}"

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * self.element_size


def decode_shapes(models: list[str], element_size: int = 2) -> list[Shape]:
    """qkv, o_proj, gate_up, down (fused as nanoserve runs them) and lm_head of each model in benchmarks/common.py."""
    shapes = []
    for model in models:
        cfg = MODEL_CONFIGS[model]
        h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        shapes += [Shape(model, layer, n, k, element_size) for layer, n, k in (
            ("qkv", q + 2 * kv, h), ("o_proj", h, q), ("gate_up", 2 * inter, h), ("down", h, inter),
            ("lm_head", cfg["vocab_size"], h))]
    return shapes


def make_weight(shape: Shape) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, weight_scale): bf16, or the fp8 codes and per-channel scales of a bf16 weight."""
    w = torch.empty(shape.n, shape.k, dtype=DTYPE, device="cuda").normal_(0, shape.k ** -0.5)
    if shape.element_size == 2:
        return w, None
    return fp8.quantize(w)


def reference(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, scale = weight
    return x.float() @ (w.float() if scale is None else fp8.dequantize(w, scale)).T


def library_linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """What runs without the kernel: cuBLAS, or for fp8 weights kernels/fp8.py's many-rows product."""
    w, scale = weight
    return F.linear(x, w) if scale is None else fp8.linear(x, w, scale)


# --------------------------------------------------------------------------------------------- compiling


def compile_jobs(shapes: list[Shape], ms: list[int], sms: int) -> list[tuple[int, int, str]]:
    """(m, k, config) launches that together compile every kernel the sweep runs: a kernel is specialised on its
    constexprs (tiles, EVEN_K, ...) and on K, not on N (every decode N is a multiple of 16, like the N used here)."""
    jobs, seen = [], set()
    for shape in shapes:
        size = shape.element_size
        for m in ms:
            cfgs = configs_for(m, shape.n, shape.k, sms, size) + [gemv.choose(m, shape.n, shape.k, size)[0]]
            for cfg in cfgs:
                p = gemv.plan(cfg, m, shape.n, shape.k, sms, size, DTYPE.itemsize)
                key = (p.block_m, p.block_n, p.block_k, p.use_dot, p.num_warps, p.num_stages, p.reduce_chunk,
                       shape.k % p.block_k == 0, size)
                if key not in seen:
                    seen.add(key)
                    jobs.append((m, shape.k, cfg.short(), size))
    return jobs


def _compile_worker(jobs: list[tuple[int, int, str, int]]) -> list[str]:
    """In a worker process: run each launch once (PDL on and off) so that Triton's on-disk cache holds it."""
    errors = []
    for m, k, name, size in jobs:
        try:
            x = torch.randn(m, k, dtype=DTYPE, device="cuda")
            w, scale = make_weight(Shape("compile", "job", 64, k, size))
            for pdl in (True, False):
                with switched(pdl=pdl):
                    gemv.linear(x, w, weight_scale=scale, force_triton=True, config=GemvConfig.parse(name))
            torch.cuda.synchronize()
        except Exception as exc:
            errors.append(f"M={m} K={k} {name}: {type(exc).__name__}: {exc}"[:300])
    return errors


def precompile(shapes: list[Shape], ms: list[int], sms: int, workers: int) -> dict:
    start = time.perf_counter()
    jobs = compile_jobs(shapes, ms, sms)
    chunks = [jobs[i::workers] for i in range(workers)]
    errors: list[str] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        for result in pool.map(_compile_worker, [c for c in chunks if c]):
            errors += result
    record = {"seconds": round(time.perf_counter() - start, 1), "kernels": len(jobs), "workers": workers,
              "errors": errors}
    print(f"compiled {len(jobs)} kernel variants in {record['seconds']} s with {workers} workers "
          f"({len(errors)} failed)", flush=True)
    return record


# --------------------------------------------------------------------------------------------- measuring


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def graph_us_per_call(call, copies: int) -> dict:
    """call(i) runs one linear on weight copy i. Returns the median (and min) µs per call of a graph replay."""
    calls = max(MIN_CALLS, copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (compiles, allocates the split-K counters)
        for i in range(min(copies, 3)):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(SAMPLES):
        start.record()
        for _ in range(REPLAYS_PER_SAMPLE):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (calls * REPLAYS_PER_SAMPLE))
    del graph
    return {"us": statistics.median(samples), "us_min": min(samples), "calls_per_graph": calls}


def measure(call, copies: int, ref: torch.Tensor, moved_bytes: int, err_ok: float = ERR_OK) -> dict:
    """Correctness of call(0), then its graph timing; any exception is recorded, not raised."""
    record: dict = {}
    try:
        out = call(0)
        torch.cuda.synchronize()
        record["rel_err"] = rel_err(out, ref)
        record["ok"] = bool(torch.isfinite(out).all()) and record["rel_err"] <= err_ok
        record.update(graph_us_per_call(call, copies))
        record["tb_per_s"] = moved_bytes / (record["us"] * 1e-6) / 1e12
    except Exception as exc:  # one bad variant must not stop the sweep
        record["ok"] = False
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
        record["traceback"] = traceback.format_exc().splitlines()[-3:]
    return record


def config_record(cfg: GemvConfig, m: int, shape: Shape, sms: int) -> dict:
    p = gemv.plan(cfg, m, shape.n, shape.k, sms, shape.element_size, DTYPE.itemsize)
    return {"name": cfg.short(), "split_k": p.split_k, "grid": list(p.grid),
            "launch_key": list(launch_key(cfg, m, shape.n, shape.k, sms, shape.element_size))}


def bench_case(shape: Shape, m: int, weights: list[tuple], sms: int, deadline: float) -> dict:
    copies = len(weights)
    x = torch.randn(m, shape.k, dtype=DTYPE, device="cuda")
    ref = reference(x, weights[0])
    moved = shape.weight_bytes + (m * shape.k + m * shape.n) * DTYPE.itemsize
    case = {"model": shape.model, "layer": shape.layer, "n": shape.n, "k": shape.k, "m": m,
            "weight_bytes": shape.weight_bytes, "element_size": shape.element_size, "weight_copies": copies}
    case["cublas"] = measure(lambda i: library_linear(x, weights[i]), copies, ref, moved,
                             ERR_OK if shape.element_size == 2 else ERR_OK_W8A8)
    if shape.element_size == 1:  # what the fp8 kernel must beat: the bf16 matrix through cuBLAS
        bf16 = [fp8.dequantize(w, s, DTYPE) for w, s in weights]
        case["bf16_cublas"] = measure(lambda i: F.linear(x, bf16[i]), copies, ref, moved)
        del bf16
    table_cfg, triton_wins = gemv.choose(m, shape.n, shape.k, shape.element_size)
    run = lambda cfg: lambda i: gemv.linear(x, weights[i][0], weight_scale=weights[i][1],  # noqa: E731
                                            force_triton=True, config=cfg)
    case["table"] = {**config_record(table_cfg, m, shape, sms), "table_says": TRITON if triton_wins else CUBLAS,
                     **measure(run(table_cfg), copies, ref, moved)}
    with switched(pdl=False):
        case["table_no_pdl"] = measure(run(table_cfg), copies, ref, moved)
    case["configs"], case["skipped_configs"] = [], 0
    for cfg in configs_for(m, shape.n, shape.k, sms, shape.element_size):
        if time.perf_counter() > deadline:
            case["skipped_configs"] += 1
            continue
        case["configs"].append({**config_record(cfg, m, shape, sms), **measure(run(cfg), copies, ref, moved)})
    timed = [c for c in case["configs"] + [case["table"]] if c.get("ok") and "us" in c]
    case["best"] = min(timed, key=lambda c: c["us"]) if timed else None
    return case


def bench_shape(shape: Shape, ms: list[int], sms: int, l2_bytes: int, deadline: float) -> list[dict]:
    copies = max(2, min(MAX_COPIES, math.ceil(3 * l2_bytes / shape.weight_bytes)))
    weights = [make_weight(shape) for _ in range(copies)]
    cases = []
    start = time.perf_counter()
    for i, m in enumerate(ms):  # each row count gets its share of the shape's time
        case_deadline = start + (deadline - start) * (i + 1) / len(ms)
        cases.append(bench_case(shape, m, weights, sms, case_deadline))
        print_case(cases[-1])
    del weights
    torch.cuda.empty_cache()
    return cases


def extra_checks() -> list[dict]:
    """Bias, odd N, fp16, and split-K counters across CUDA-graph replays with changing inputs."""
    checks = []

    def run(name, m, n, k, dtype=DTYPE, bias=False, config=None, graph=False):
        record = {"name": name, "m": m, "n": n, "k": k, "dtype": str(dtype)[6:], "bias": bias,
                  "config": config.short() if config else "table"}
        try:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            w = torch.empty(n, k, dtype=dtype, device="cuda").normal_(0, k ** -0.5)
            b = torch.randn(n, dtype=dtype, device="cuda") if bias else None
            call = lambda: gemv.linear(x, w, b, force_triton=True, config=config)  # noqa: E731
            want = lambda: F.linear(x.float(), w.float(), b.float() if bias else None)  # noqa: E731
            if not graph:
                record["rel_err"] = rel_err(call(), want())
            else:
                call()  # warm-up: compile, counters
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = call()
                errs = []
                for _ in range(3):
                    x.copy_(torch.randn_like(x))
                    g.replay()
                    errs.append(rel_err(out, want()))
                record["rel_err"] = max(errs)
                record["counters_zero_after"] = int(gemv._counters[x.device].count_nonzero()) == 0
            torch.cuda.synchronize()
            record["ok"] = record["rel_err"] <= ERR_OK and record.get("counters_zero_after", True)
        except Exception as exc:
            record["ok"], record["error"] = False, f"{type(exc).__name__}: {exc}"[:500]
        checks.append(record)
        print(f"  {'ok  ' if record['ok'] else 'FAIL'} {name}: rel_err={record.get('rel_err', '-')} "
              f"{record.get('error', '')}", flush=True)

    run("qkv bias (qwen2-style)", 3, 4096, 1024, bias=True)
    run("qkv bias, split-K", 1, 4096, 1024, bias=True, config=GemvConfig(8, 256, split_k=4))
    run("odd N", 5, 1001, 1024, bias=True)
    run("odd N, K not a multiple of block_k", 2, 999, 1040, config=GemvConfig(16, 512, split_k=2))
    run("fp16, 64 rows", 64, 2048, 2048, dtype=torch.float16)
    run("graph replay, split-K fma", 1, 1024, 2048, bias=True, config=GemvConfig(8, 256, split_k=4), graph=True)
    run("graph replay, split-K dot, 48 rows", 48, 1024, 3072, config=GemvConfig(32, 256, use_dot=True, split_k=6),
        graph=True)
    return checks


# --------------------------------------------------------------------------------------------- the table


def timing_lookup(case: dict) -> dict:
    """launch key → µs for every correct timed variant of a case."""
    return {tuple(c["launch_key"]): c["us"] for c in case["configs"] + [case["table"]] if c.get("ok") and "us" in c}


def best_shared(cases: list[dict], sms: int) -> tuple[str | None, float]:
    """The variant timed on every case whose worst ratio to each case's best Triton time is smallest."""
    m, size = cases[0]["m"], cases[0].get("element_size", 2)
    candidates = {c.short(): c for c in sweep_configs(m, size)}
    for case in cases:
        candidates.setdefault(case["table"]["name"], GemvConfig.parse(case["table"]["name"]))
    best_name, best_worst = None, math.inf
    lookups = [timing_lookup(case) for case in cases]
    for name, cfg in sorted(candidates.items()):
        ratios = []
        for case, lookup in zip(cases, lookups):
            us = lookup.get(launch_key(cfg, m, case["n"], case["k"], sms, size))
            if us is None:
                break
            ratios.append(us / case["best"]["us"])
        else:
            if max(ratios) < best_worst:
                best_name, best_worst = name, max(ratios)
    return best_name, best_worst


def derive_table(cases: list[dict], sms: int) -> dict[int, list[tuple[float | None, str, str]]]:
    """Per rows bucket: consecutive shapes (by weight size) with the same winner share an entry while one
    variant stays within SHARE_SLACK of each one's best; entry bounds sit at the geometric middle between groups."""
    table = {}
    for m in sorted({c["m"] for c in cases}):
        rows = sorted((c for c in cases if c["m"] == m and c.get("best") and "us" in c["cublas"]),
                      key=lambda c: c["weight_bytes"])
        groups: list[dict] = []
        for case in rows:
            winner = TRITON if case["best"]["us"] < case["cublas"]["us"] * (1 - WIN_MARGIN) else CUBLAS
            if groups and groups[-1]["winner"] == winner:
                name, worst = best_shared(groups[-1]["cases"] + [case], sms)
                if name is not None and worst <= SHARE_SLACK:
                    groups[-1]["cases"].append(case)
                    groups[-1]["config"] = name
                    continue
            groups.append({"winner": winner, "cases": [case], "config": case["best"]["name"]})
        entries = []
        for group, nxt in zip(groups, groups[1:] + [None]):
            if nxt is None:
                limit = None
            else:
                middle = math.sqrt(group["cases"][-1]["weight_bytes"] * nxt["cases"][0]["weight_bytes"])
                limit = round(middle / 2**20, 1)
            entries.append((limit, group["config"], group["winner"]))
        if entries:
            table[m] = entries
    return table


def table_source(table: dict, name: str = "GEMV_TABLE") -> str:
    """The table as Python for nanoserve/kernels/gemv.py (GEMV_TABLE, or FP8_GEMV_TABLE)."""
    lines = [f"{name}: dict[int, tuple[tuple[float | None, str, str], ...]] = {{"]
    for m, entries in table.items():
        items = [f"({limit!r}, {cfg!r}, {'TRITON' if w == TRITON else 'CUBLAS'})" for limit, cfg, w in entries]
        lines.append(f"    {m}: ({', '.join(items)}{',' if len(items) == 1 else ''}),")
    lines.append("}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- reporting


def print_case(case: dict) -> None:
    cb, tb, best = case["cublas"], case["table"], case["best"]

    def cell(r):
        return f"{r['us']:7.2f}us {r['tb_per_s']:4.2f}TB/s{'' if r['ok'] else '!'}" if "us" in r else f"{'ERROR':>18s}"

    speed = (lambda r: f"x{cb['us'] / r['us']:4.2f}" if r and "us" in r and "us" in cb else "  -  ")
    line = (f"{case['model']:>12s} {case['layer']:<7s} {case['n']:>6d}x{case['k']:<5d} M={case['m']:<2d} "
            f"{'cuBLAS' if case.get('element_size', 2) == 2 else 'fp8lib'} {cell(cb)} | table {cell(tb)} "
            f"{speed(tb)} | best ")
    if "bf16_cublas" in case:
        line = f"{line[:-7]}| bf16 cuBLAS {cell(case['bf16_cublas'])} | best "
    line += f"{cell(best)} {speed(best)} {best['name']} s{best['split_k']}" if best else "none"
    errors = sum("error" in c for c in case["configs"])
    if errors or case["skipped_configs"]:
        line += f"  [{errors} errors, {case['skipped_configs']} skipped]"
    print(line, flush=True)


def summarize(cases: list[dict], checks: list[dict]) -> dict:
    bad = []  # timed but wrong
    for c in cases:
        for label, r in [("cublas", c["cublas"]), ("table", c["table"])] + [(r["name"], r) for r in c["configs"]]:
            if "rel_err" in r and not r["ok"]:
                bad.append(f"{c['model']}/{c['layer']} M={c['m']} {label} rel_err={r['rel_err']:.3g}")
    pdl_gain = [c["table_no_pdl"]["us"] / c["table"]["us"] for c in cases
                if "us" in c["table"] and "us" in c.get("table_no_pdl", {})]
    return {
        "correct": not bad and all(ch["ok"] for ch in checks),
        "wrong_results": bad,
        "variant_errors": sum("error" in r for c in cases for r in c["configs"] + [c["table"]]),
        "table_geomean_speedup_vs_cublas": _geomean([c["cublas"]["us"] / c["table"]["us"] for c in cases
                                                     if "us" in c["cublas"] and "us" in c["table"]]),
        "best_geomean_speedup_vs_cublas": _geomean([c["cublas"]["us"] / c["best"]["us"] for c in cases
                                                    if c["best"] and "us" in c["cublas"]]),
        "pdl_geomean_speedup_of_table_variant": _geomean(pdl_gain),
    }


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where to write the JSON report")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="wall-clock budget of the whole run; the variant sweep stops in time for the rest")
    parser.add_argument("--m", default="1,2,4,8,16,32,64", help="comma-separated row counts")
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_CONFIGS), choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--fp8", action="store_true", help="fp8 weights (per-channel scales): FP8_GEMV_TABLE")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemv.py needs a CUDA GPU")
    if not HAS_TRITON:
        sys.exit("benchmarks/gemv.py needs triton")
    ms = sorted({int(v) for v in args.m.split(",")})
    if any(not 1 <= m <= gemv.MAX_M for m in ms):
        sys.exit(f"--m values must be in 1..{gemv.MAX_M}")
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2_bytes = getattr(props, "L2_cache_size", 60 * 2**20) or 60 * 2**20
    report = {"environment": {**env_info(), "sm_count": sms, "l2_bytes": l2_bytes},
              "method": "CUDA graph of back-to-back calls rotating through weight copies >= 3x L2; "
                        f"median of {SAMPLES} samples of {REPLAYS_PER_SAMPLE} replays, per call",
              "weights": "float8_e4m3fn + per-channel scales" if args.fp8 else "bfloat16",
              "table_before": {str(m): list(v) for m, v in (gemv.FP8_GEMV_TABLE if args.fp8
                                                             else gemv.GEMV_TABLE).items()},
              "win_margin": WIN_MARGIN, "share_slack": SHARE_SLACK, "cases": [], "extra_checks": []}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    print(f"{report['environment']['gpu']}  torch {torch.__version__}  triton {report['environment']['triton']}  "
          f"{sms} SMs  L2 {l2_bytes / 2**20:.0f} MiB", flush=True)
    torch.manual_seed(0)
    shapes = sorted(decode_shapes(args.models, 1 if args.fp8 else 2), key=lambda s: s.weight_bytes)
    report["precompile"] = precompile(shapes, ms, sms, max(1, args.workers))
    sweep_end = start + args.budget_s - RESERVE_S
    for i, shape in enumerate(shapes):
        now = time.perf_counter()  # share what is left of the budget among the remaining shapes
        deadline = now + max(0.0, sweep_end - now) / (len(shapes) - i)
        try:
            report["cases"] += bench_shape(shape, ms, sms, l2_bytes, deadline)
        except Exception as exc:  # e.g. out of memory for the weight copies
            print(f"  FAILED {shape.name}: {type(exc).__name__}: {exc}", flush=True)
            report["cases"].append({"model": shape.model, "layer": shape.layer,
                                    "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        write_json(args.output, report)
    if not args.fp8:  # bf16 products (the fp8 paths' extra cases are GPU tests: tests/kernels/test_fp8.py)
        print("\nextra checks", flush=True)
        report["extra_checks"] = extra_checks()
    complete = [c for c in report["cases"] if "cublas" in c]
    table = derive_table(complete, sms)
    report["table"] = {str(m): v for m, v in table.items()}
    report["table_source"] = table_source(table, "FP8_GEMV_TABLE" if args.fp8 else "GEMV_TABLE")
    report["summary"] = summarize(complete, report["extra_checks"])
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json(args.output, report)
    s = report["summary"]
    print(f"\nsuggested dispatch table for nanoserve/kernels/gemv.py:\n{report['table_source']}", flush=True)
    print(f"\ncorrect: {s['correct']} {s['wrong_results'][:5]}  variant errors: {s['variant_errors']}  "
          f"geomean speedup vs cuBLAS: table x{s['table_geomean_speedup_vs_cublas'] or float('nan'):.2f}, "
          f"best x{s['best_geomean_speedup_vs_cublas'] or float('nan'):.2f}; PDL on the table variant "
          f"x{s['pdl_geomean_speedup_of_table_variant'] or float('nan'):.2f}", flush=True)
    print(f"wrote {args.output} in {report['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
