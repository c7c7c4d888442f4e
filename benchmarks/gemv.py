"""GPU benchmark of the one-launch skinny matmul (nanoserve/kernels/gemv.py) against cuBLAS (F.linear).

    python benchmarks/gemv.py benchmarks/results/gemv_h200.json [--budget-s 165] [--m 1,2,4,8,16]

For the decode linear layers of Qwen3-0.6B and Llama-3.1-8B (bf16) and M = 1, 2, 4, 8, 16 rows:
correctness (max error relative to the largest output, against an fp32 reference, for cuBLAS and
every Triton variant), then the time per call of cuBLAS, of the module's default variant, and of
every swept variant (configs_for), the achieved TB/s, and the best variant per (shape, M).
It ends with a few extra checks (bias, odd N, split-K under CUDA-graph replay) and suggests the
module constants (default variants, FMA_MAX_M, MAX_M, MAX_WEIGHT_BYTES) from the measurements.

Timing: for each variant, a CUDA graph of back-to-back calls is captured; the calls rotate through
copies of the weight that together hold >= 3x the L2 cache, so every call streams its weight
from HBM as in a real decode step. The graph is replayed (3 replays per sample, 7 samples) and
the time per call is the median sample / calls. It includes the launch gap between kernels in a
graph — what a decode step pays — and cuBLAS's separate split-K reduce kernel where it uses one.

Every variant is isolated: a failure is recorded in the JSON and the run goes on. The JSON is
rewritten after every shape. All variants are compiled first; the sweep then shares what is left
of --budget-s among the shapes and skips the variants it has no time for (cuBLAS and the default
are always timed), so the run stays under 3 minutes. Compiled kernels are cached (~/.triton), so a
second run has more time for the sweep.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import MODEL_CONFIGS, env_info, head_dim, write_json  # noqa: E402
from nanoserve.kernels import gemv  # noqa: E402
from nanoserve.kernels._triton import HAS_TRITON  # noqa: E402
from nanoserve.kernels.gemv import GemvConfig  # noqa: E402

DTYPE = torch.bfloat16
COPY_TBPS = 4.2  # measured device-to-device copy bandwidth of the H200, the practical ceiling
ERR_OK = 1e-2  # max |out - ref| / max |ref|: bf16 rounding is ~4e-3
SAMPLES, REPLAYS_PER_SAMPLE, MIN_CALLS, MAX_COPIES = 7, 3, 20, 64
RESERVE_S = 20.0  # of --budget-s, kept for the last shape's cuBLAS/default timings, the extra checks, the summary


@dataclass(frozen=True)
class Shape:
    model: str
    layer: str
    n: int
    k: int

    @property
    def name(self) -> str:
        return f"{self.model}/{self.layer}"

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * DTYPE.itemsize


def decode_shapes() -> list[Shape]:
    """qkv, o_proj, gate_up and down of each model in benchmarks/common.py (fused as nanoserve runs them)."""
    shapes = []
    for model in ("qwen3-0.6b", "llama-3.1-8b"):
        cfg = MODEL_CONFIGS[model]
        h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        shapes += [Shape(model, "qkv", q + 2 * kv, h), Shape(model, "o_proj", h, q),
                   Shape(model, "gate_up", 2 * inter, h), Shape(model, "down", h, inter)]
    return shapes


# --------------------------------------------------------------------------------------------- the sweep

# (block_n, block_k, num_warps, num_stages) per path, and split rules.
SWEEP_FMA_TILES = ((4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 2), (8, 512, 4, 1), (16, 512, 4, 3),
                   (16, 256, 4, 4), (16, 1024, 8, 2), (32, 256, 8, 3), (32, 512, 8, 3))
SWEEP_DOT_TILES = ((16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 512, 4, 2), (64, 128, 4, 4),
                   (64, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3))
SWEEP_PROGRAMS_PER_SM = (0, 1, 2, 4)
SWEEP_FMA_MAX_M = 4  # the FMA path is swept up to this many rows, the dot path from 2 rows
H200_SMS = 132  # SM count assumed when no GPU says otherwise (tests of the sweep logic)


def sweep_configs(m: int) -> list[GemvConfig]:
    """Every swept variant for m rows, before removing those that resolve to the same launch."""
    paths = [(False, t) for t in SWEEP_FMA_TILES] if m <= SWEEP_FMA_MAX_M else []
    paths += [(True, t) for t in SWEEP_DOT_TILES] if m >= 2 else []
    return [GemvConfig(bn, bk, warps, stages, use_dot, per_sm)
            for use_dot, (bn, bk, warps, stages) in paths for per_sm in SWEEP_PROGRAMS_PER_SM]


def launch_key(config: GemvConfig, m: int, n: int, k: int, sms: int) -> tuple:
    """Two configs with the same key run the same launch on this shape."""
    p = gemv.plan(config, m, n, k, sms)
    return (p.use_dot, p.block_n, p.block_k, p.num_warps, p.num_stages, p.split_k)


def configs_for(m: int, n: int, k: int, sms: int = H200_SMS) -> list[GemvConfig]:
    """The swept variants worth timing for one shape: one per distinct launch."""
    out, seen = [], set()
    for cfg in sweep_configs(m):
        key = launch_key(cfg, m, n, k, sms)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


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


def measure(call, copies: int, ref: torch.Tensor, moved_bytes: int) -> dict:
    """Correctness of call(0), then its graph timing; any exception is recorded, not raised."""
    record: dict = {}
    try:
        out = call(0)
        torch.cuda.synchronize()
        record["rel_err"] = rel_err(out, ref)
        record["ok"] = bool(torch.isfinite(out).all()) and record["rel_err"] <= ERR_OK
        record.update(graph_us_per_call(call, copies))
        record["tb_per_s"] = moved_bytes / (record["us"] * 1e-6) / 1e12
    except Exception as exc:  # one bad variant must not stop the sweep
        record["ok"] = False
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
        record["traceback"] = traceback.format_exc().splitlines()[-3:]
    return record


def config_record(cfg: GemvConfig, m: int, shape: Shape, sms: int) -> dict:
    p = gemv.plan(cfg, m, shape.n, shape.k, sms)
    return {"name": cfg.short(), "config": asdict(cfg), "split_k": p.split_k, "grid": list(p.grid),
            "launch_key": list(launch_key(cfg, m, shape.n, shape.k, sms))}


def bench_shape(shape: Shape, ms: list[int], sms: int, l2_bytes: int, deadline: float) -> list[dict]:
    copies = max(2, min(MAX_COPIES, math.ceil(3 * l2_bytes / shape.weight_bytes)))
    weights = [torch.empty(shape.n, shape.k, dtype=DTYPE, device="cuda").normal_(0, shape.k ** -0.5)
               for _ in range(copies)]
    cases = []
    for m in ms:
        x = torch.randn(m, shape.k, dtype=DTYPE, device="cuda")
        ref = x.float() @ weights[0].float().T
        moved = shape.weight_bytes + (m * shape.k + m * shape.n) * DTYPE.itemsize
        case = {"model": shape.model, "layer": shape.layer, "n": shape.n, "k": shape.k, "m": m,
                "weight_bytes": shape.weight_bytes, "weight_copies": copies}
        case["cublas"] = measure(lambda i: F.linear(x, weights[i]), copies, ref, moved)
        default = gemv.default_config(m, shape.n, shape.k)
        case["default"] = {**config_record(default, m, shape, sms),
                           **measure(lambda i: gemv.linear(x, weights[i], force_triton=True), copies, ref, moved)}
        case["auto_uses_kernel"] = gemv.kernel_applies(x, weights[0], None)
        case["configs"], case["skipped_configs"] = [], 0
        for cfg in configs_for(m, shape.n, shape.k, sms):
            if time.perf_counter() > deadline:
                case["skipped_configs"] += 1
                continue
            case["configs"].append({**config_record(cfg, m, shape, sms), **measure(
                lambda i, cfg=cfg: gemv.linear(x, weights[i], force_triton=True, config=cfg), copies, ref, moved)})
        timed = [c for c in case["configs"] + [case["default"]] if c.get("ok") and "us" in c]
        case["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        cases.append(case)
        print_case(case)
    del weights
    torch.cuda.empty_cache()
    return cases


def precompile(ms: list[int], sms: int) -> dict:
    """Compile every swept kernel variant once (a 4096x4096 weight has the same integer specialisations as
    the benchmark shapes), so the budgeted sweep times runs, not compiles."""
    start, errors = time.perf_counter(), []
    w = torch.empty(4096, 4096, dtype=DTYPE, device="cuda").normal_(0, 4096 ** -0.5)
    for m in ms:
        x = torch.randn(m, 4096, dtype=DTYPE, device="cuda")
        for cfg in configs_for(m, 4096, 4096, sms):
            try:
                gemv.linear(x, w, force_triton=True, config=cfg)
                torch.cuda.synchronize()
            except Exception as exc:
                errors.append(f"M={m} {cfg.short()}: {type(exc).__name__}: {exc}"[:300])
    record = {"seconds": round(time.perf_counter() - start, 1), "errors": errors}
    print(f"precompiled the variants in {record['seconds']} s ({len(errors)} failed)", flush=True)
    return record


def extra_checks() -> list[dict]:
    """Bias, odd N, fp16, and split-K counters across CUDA-graph replays with changing inputs."""
    checks = []

    def run(name, m, n, k, dtype=DTYPE, bias=False, config=None, graph=False):
        record = {"name": name, "m": m, "n": n, "k": k, "dtype": str(dtype)[6:], "bias": bias,
                  "config": config.short() if config else "default"}
        try:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            w = torch.empty(n, k, dtype=dtype, device="cuda").normal_(0, k ** -0.5)
            b = torch.randn(n, dtype=dtype, device="cuda") if bias else None
            call = lambda: gemv.linear(x, w, b, force_triton=True, config=config)  # noqa: E731
            if not graph:
                out = call()
                record["rel_err"] = rel_err(out, F.linear(x.float(), w.float(), b.float() if bias else None))
            else:
                call()  # warm-up: compile, counters
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = call()
                errs = []
                for _ in range(3):
                    x.copy_(torch.randn_like(x))
                    g.replay()
                    errs.append(rel_err(out, F.linear(x.float(), w.float(), b.float() if bias else None)))
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
    run("fp16", 4, 2048, 2048, dtype=torch.float16)
    run("graph replay, split-K fma", 1, 1024, 2048, bias=True, config=GemvConfig(8, 256, split_k=4), graph=True)
    run("graph replay, split-K dot", 8, 1024, 3072, config=GemvConfig(32, 256, use_dot=True, split_k=6), graph=True)
    return checks


# --------------------------------------------------------------------------------------------- reporting


def print_case(case: dict) -> None:
    cb, df, best = case["cublas"], case["default"], case["best"]

    def cell(r):
        if "us" not in r:
            return f"{'ERROR':>20s}"
        return f"{r['us']:7.2f}us {r['tb_per_s']:4.2f}TB/s{'' if r['ok'] else '!'}"

    speed = (lambda r: f"x{cb['us'] / r['us']:4.2f}" if r and "us" in r and "us" in cb else "  -  ")
    line = (f"{case['model']:>12s} {case['layer']:<7s} {case['n']:>5d}x{case['k']:<5d} M={case['m']:<2d} "
            f"cuBLAS {cell(cb)} | default {cell(df)} {speed(df)} | best ")
    line += f"{cell(best)} {speed(best)} {best['name']} s{best['split_k']}" if best else "none"
    errors = sum("error" in c for c in case["configs"])
    if errors or case["skipped_configs"]:
        line += f"  [{errors} errors, {case['skipped_configs']} skipped]"
    print(line, flush=True)


def timing_lookup(case: dict) -> dict:
    """launch key → µs for every correct timed variant of a case."""
    return {tuple(c["launch_key"]): c["us"] for c in case["configs"] + [case["default"]]
            if c.get("ok") and "us" in c}


def score_policies(cases: list[dict], use_dot: bool, sms: int) -> list[tuple[float, GemvConfig]]:
    """Geometric mean over cases of (policy time / best Triton time); only policies timed in every case."""
    scored = []
    for cfg in {c for m in sorted({case["m"] for case in cases}) for c in sweep_configs(m) if c.use_dot == use_dot}:
        ratios = []
        for case in cases:
            us = timing_lookup(case).get(launch_key(cfg, case["m"], case["n"], case["k"], sms))
            if us is None or not case["best"]:
                break
            ratios.append(us / case["best"]["us"])
        else:
            if ratios:
                scored.append((math.exp(sum(map(math.log, ratios)) / len(ratios)), cfg))
    return sorted(scored, key=lambda s: (s[0], s[1].short()))


def policy_us(case: dict, cfg: GemvConfig, sms: int) -> float | None:
    return timing_lookup(case).get(launch_key(cfg, case["m"], case["n"], case["k"], sms))


def suggest(cases: list[dict], sms: int) -> dict:
    """Default variants, FMA_MAX_M, and the (MAX_M, MAX_WEIGHT_BYTES) rule that saves the most time."""
    fma_cases = [c for c in cases if c["m"] <= SWEEP_FMA_MAX_M]
    dot_cases = [c for c in cases if c["m"] >= 2]
    fma_scores, dot_scores = score_policies(fma_cases, False, sms), score_policies(dot_cases, True, sms)
    if not fma_scores or not dot_scores:
        return {"error": "too few complete measurements to suggest settings"}
    fma, dot = fma_scores[0][1], dot_scores[0][1]
    # FMA_MAX_M: the largest row count up to which the FMA default beats the dot default (geomean over shapes).
    fma_max_m = 1
    for m in sorted({c["m"] for c in cases if 2 <= c["m"] <= SWEEP_FMA_MAX_M}):
        pairs = [(policy_us(c, fma, sms), policy_us(c, dot, sms)) for c in cases if c["m"] == m]
        pairs = [(a, b) for a, b in pairs if a and b]
        if not pairs or sum(math.log(a / b) for a, b in pairs) > 0:
            break
        fma_max_m = m

    def chosen_us(case):
        return policy_us(case, fma if case["m"] <= fma_max_m else dot, sms)

    # The rule: kernel iff M <= MAX_M and weight bytes <= MAX_WEIGHT_BYTES. Pick the one that saves the most µs.
    sizes = sorted({c["weight_bytes"] for c in cases})
    best_rule, best_saved = (0, 0), 0.0
    for max_m in sorted({c["m"] for c in cases}):
        for limit in sizes:
            saved = 0.0
            for c in cases:
                us = chosen_us(c)
                if c["m"] <= max_m and c["weight_bytes"] <= limit and us and "us" in c["cublas"]:
                    saved += c["cublas"]["us"] - us
            if saved > best_saved:
                best_rule, best_saved = (max_m, limit), saved
    max_m, limit = best_rule
    if best_saved <= 0:
        return {"error": "the kernel never beat cuBLAS: keep it off (MAX_M = 0)", "max_m": 0}
    above = [s for s in sizes if s > limit]
    # A MiB value between the largest shape kept and the smallest shape left to cuBLAS (none measured
    # above: just above the largest measured shape, the kernel was not measured on larger ones).
    limit_mib = (limit + above[0]) // 2 // 2**20 if above else limit // 2**20 + 1
    speedups = {f"{c['model']}/{c['layer']}": {} for c in cases}
    for c in cases:
        us = chosen_us(c)
        speedups[f"{c['model']}/{c['layer']}"][c["m"]] = (c["cublas"]["us"] / us) if us and "us" in c["cublas"] else None
    cfg_src = lambda c: ", ".join(f"{k}={v!r}" for k, v in asdict(c).items() if k != "split_k")  # noqa: E731
    constants = (f"MAX_M = {max_m}\nFMA_MAX_M = {fma_max_m}\n"
                 f"MAX_WEIGHT_BYTES = {limit_mib} * 2**20\n"
                 f"FMA_CONFIG = GemvConfig({cfg_src(fma)})\nDOT_CONFIG = GemvConfig({cfg_src(dot)})")
    return {"fma_config": asdict(fma), "fma_score": fma_scores[0][0], "fma_runners_up": [
                (round(s, 3), c.short()) for s, c in fma_scores[1:4]],
            "dot_config": asdict(dot), "dot_score": dot_scores[0][0], "dot_runners_up": [
                (round(s, 3), c.short()) for s, c in dot_scores[1:4]],
            "fma_max_m": fma_max_m, "max_m": max_m, "max_weight_bytes": limit_mib * 2**20,
            "saved_us_over_cases": best_saved, "speedup_vs_cublas": speedups, "constants": constants,
            "note": "score = geomean(time / best Triton time) over shapes and M; 1.0 = best everywhere"}


def print_summary(cases: list[dict], suggestion: dict) -> None:
    print("\nbest variant per (shape, M):", flush=True)
    for c in cases:
        b = c["best"]
        if b:
            print(f"  {c['model']}/{c['layer']:<8s} M={c['m']:<2d} {b['name']:<28s} split {b['split_k']:<2d} "
                  f"{b['us']:6.2f}us vs cuBLAS {c['cublas'].get('us', float('nan')):6.2f}us", flush=True)
    if "error" in suggestion:
        print(f"\nno suggestion: {suggestion['error']}", flush=True)
        return
    print(f"\nsuggested defaults: FMA {GemvConfig(**suggestion['fma_config']).short()} "
          f"(score {suggestion['fma_score']:.3f}), DOT {GemvConfig(**suggestion['dot_config']).short()} "
          f"(score {suggestion['dot_score']:.3f}); speedup vs cuBLAS with them:", flush=True)
    ms = sorted({c["m"] for c in cases})
    print("  " + " " * 22 + "".join(f"M={m:<6d}" for m in ms), flush=True)
    for name, row in suggestion["speedup_vs_cublas"].items():
        print(f"  {name:<22s}" + "".join(f"{row[m]:<8.2f}" if row.get(m) else f"{'-':<8s}" for m in ms), flush=True)
    print(f"\nsuggested module constants for nanoserve/kernels/gemv.py "
          f"(saves {suggestion['saved_us_over_cases']:.1f} us over these cases):\n{suggestion['constants']}", flush=True)


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where to write the JSON report")
    parser.add_argument("--budget-s", type=float, default=165.0,
                        help="wall-clock budget of the whole run; the variant sweep stops in time for the rest")
    parser.add_argument("--m", default="1,2,4,8,16", help="comma-separated row counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemv.py needs a CUDA GPU")
    if not HAS_TRITON:
        sys.exit("benchmarks/gemv.py needs triton")
    ms = [int(v) for v in args.m.split(",")]
    if any(not 1 <= m <= gemv.MAX_M for m in ms):
        sys.exit(f"--m values must be in 1..{gemv.MAX_M}")
    start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2_bytes = getattr(props, "L2_cache_size", 60 * 2**20) or 60 * 2**20
    import triton

    report = {"environment": {**env_info(), "triton": triton.__version__, "sm_count": sms, "l2_bytes": l2_bytes},
              "method": "CUDA graph of back-to-back calls rotating through weight copies >= 3x L2; "
                        f"median of {SAMPLES} samples of {REPLAYS_PER_SAMPLE} replays, per call",
              "module_settings": {k: getattr(gemv, k) for k in ("MAX_M", "FMA_MAX_M", "MIN_WEIGHT_BYTES",
                                                                "MAX_WEIGHT_BYTES", "MAX_SPLIT_K")},
              "module_defaults": {"fma": asdict(gemv.FMA_CONFIG), "dot": asdict(gemv.DOT_CONFIG)},
              "copy_tb_per_s_assumed": COPY_TBPS, "cases": [], "extra_checks": [], "precompile": None}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    print(f"{report['environment']['gpu']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{sms} SMs  L2 {l2_bytes / 2**20:.0f} MiB", flush=True)
    torch.manual_seed(0)
    report["precompile"] = precompile(ms, sms)
    shapes = decode_shapes()
    sweep_end = start + args.budget_s - RESERVE_S
    for i, shape in enumerate(shapes):
        # Share what is left of the budget among the remaining shapes.
        now = time.perf_counter()
        deadline = now + max(0.0, sweep_end - now) / (len(shapes) - i)
        try:
            report["cases"] += bench_shape(shape, ms, sms, l2_bytes, deadline)
        except Exception as exc:  # e.g. out of memory for the weight copies
            print(f"  FAILED {shape.name}: {type(exc).__name__}: {exc}", flush=True)
            report["cases"].append({"model": shape.model, "layer": shape.layer, "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        write_json(args.output, report)
    print("\nextra checks", flush=True)
    report["extra_checks"] = extra_checks()
    complete = [c for c in report["cases"] if "cublas" in c]
    report["suggestion"] = suggest(complete, sms)
    bad = []  # timed but wrong
    for c in complete:
        for label, r in [("cublas", c["cublas"]), ("default", c["default"])] + [(r["name"], r) for r in c["configs"]]:
            if "rel_err" in r and not r["ok"]:
                bad.append(f"{c['model']}/{c['layer']} M={c['m']} {label} rel_err={r['rel_err']:.3g}")
    report["summary"] = {
        "correct": not bad and all(ch["ok"] for ch in report["extra_checks"]),
        "wrong_results": bad,
        "variant_errors": sum("error" in r for c in complete for r in c["configs"] + [c["default"]]),
        "default_geomean_speedup": _geomean([c["cublas"]["us"] / c["default"]["us"] for c in complete
                                             if "us" in c["cublas"] and "us" in c["default"]]),
        "best_geomean_speedup": _geomean([c["cublas"]["us"] / c["best"]["us"] for c in complete
                                          if c["best"] and "us" in c["cublas"]]),
    }
    print_summary(complete, report["suggestion"])
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json(args.output, report)
    s = report["summary"]
    print(f"\ncorrect: {s['correct']} {s['wrong_results'][:5]}  variant errors: {s['variant_errors']}  "
          f"geomean speedup vs cuBLAS: default x{s['default_geomean_speedup'] or float('nan'):.2f}, "
          f"best x{s['best_geomean_speedup'] or float('nan'):.2f}", flush=True)
    print(f"wrote {args.output} in {report['elapsed_s']} s", flush=True)


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


if __name__ == "__main__":
    main()
