"""`nanoserve bench graphs`: what each CUDA-graph size costs, and what padding costs, powers of two vs the plan.

Engines are built side by side with the same weights and KV cache: one eager engine (the baseline,
and the eager timings), one engine per size alone (its capture seconds and graph memory), one per
size set (its replay times, capture seconds and pool). Capture seconds are an engine's start-up time
minus the eager engine's; graph memory is its growth of torch.cuda.memory_reserved() over the eager
engine's — the same quantities start-up pays. The powers of two are measured first; the curve
fitted to their replay times plans the sizes (nanoserve/runner/startup/bucket_plan.py), which are then
measured too. Without CUDA (or with --enforce-eager) only the eager engine runs: the curve comes from
eager timings and graph costs are absent, so the code path still runs on a CPU.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import numpy as np
import torch

from nanoserve import LLM
from nanoserve.bench.common import environment, release_memory
from nanoserve.bench.decode_step import decode_batch, time_decode_step
from nanoserve.bench.padding import (average_padded_rows, buckets, expected_padded_ms, expected_unpadded_ms,
                                     expected_waste)
from nanoserve.config import EngineConfig, default_capture_sizes
from nanoserve.kernels.paging import blocks_for
from nanoserve.runner.startup.bucket_plan import (DEFAULT_CAPTURE_BUDGET_S, DEFAULT_POOL_BUDGET_BYTES, BatchDistribution,
                                          LinearCost, StepCurve, plan_buckets)

MiB = 2**20
SET_NAMES = {"powers_of_two": "powers of two", "plan": "plan"}


def report_engine_options(model: str, options: dict, context: int) -> tuple[EngineConfig, dict]:
    """The options every engine of the report gets: the caller's, plus sizes that let several engines
    share the GPU (unless given): max_model_len max(1024, context), KV blocks for max_num_seqs rows of
    `context` tokens. Capture sizes are the report's own; tokenizers and progress bars are skipped."""
    opts = {k: v for k, v in options.items() if k != "cudagraph_capture_sizes"}
    opts.setdefault("skip_tokenizer_init", True)
    opts.setdefault("show_progress", False)
    config = EngineConfig.from_kwargs(model, **opts)
    block = config.block_size
    opts.setdefault("max_model_len", max(1024, blocks_for(context + 1, block) * block))
    if context >= opts["max_model_len"]:
        raise ValueError(f"--context {context} must be below max_model_len={opts['max_model_len']}")
    opts.setdefault("num_kv_blocks", config.max_num_seqs * blocks_for(context, block)
                    + blocks_for(opts["max_model_len"], block))
    return config, opts


def load_distribution(spec: str, max_num_seqs: int) -> BatchDistribution:
    """'uniform' or a batch-histogram file (resized to max_num_seqs)."""
    if spec == "uniform":
        return BatchDistribution.uniform(max_num_seqs)
    return BatchDistribution.load(spec, max_num_seqs=max_num_seqs)


def run_graphs_report(model: str, engine_options: dict, distribution: str = "uniform", context: int = 512,
                      warmup: int = 3, iters: int = 20, capture_budget_s: float = DEFAULT_CAPTURE_BUDGET_S,
                      pool_budget_bytes: float = DEFAULT_POOL_BUDGET_BYTES, log=print) -> dict:
    """Measure, plan, measure the plan; returns the report (JSON-ready) and prints progress through log."""
    config, opts = report_engine_options(model, engine_options, context)
    n = config.max_num_seqs
    dist = load_distribution(distribution, n)
    with_graphs = _captures_graphs(config)
    probe = _Probe(model, opts, context, warmup, iters, with_graphs, log)
    started = time.perf_counter()
    with _quiet_engine_logs():
        probe.start()
        pow2 = default_capture_sizes(n)
        probe.measure_set("powers_of_two", pow2)
        planning_curve = probe.curve(pow2)
        plan = plan_buckets(planning_curve, dist, n, capture_budget_s, pool_budget_bytes)
        log(f"planned {len(plan)} sizes: {plan}")
        probe.measure_set("plan", plan)
        probe.stop()
    final_curve = probe.curve(sorted(probe.sizes))
    sets = {name: _set_summary(name, sizes, probe, planning_curve, final_curve, dist)
            for name, sizes in (("powers_of_two", pow2), ("plan", plan))}
    return {
        "report": "graphs", "environment": environment(), "model": model,
        "settings": {"max_num_seqs": n, "context": context, "device": config.device, "graphs": with_graphs,
                     "distribution": distribution, "warmup": warmup, "iters": iters,
                     "capture_budget_s": capture_budget_s, "pool_budget_mib": pool_budget_bytes / MiB,
                     "engine_options": opts},
        "sizes": [dict(rows=s, sets=[k for k, v in sets.items() if s in v["sizes"]], **probe.sizes[s])
                  for s in sorted(probe.sizes)],
        "curve": _curve_json(final_curve), "planning_curve": _curve_json(planning_curve),
        "mean_rows": float(dist.probabilities() @ np.arange(1, n + 1)),
        "unpadded_ms": expected_unpadded_ms(final_curve, dist),
        "sets": sets, "seconds": time.perf_counter() - started,
    }


class _Probe:
    """The engines of one report and what was measured per size: sizes[rows] = {eager_ms, replay_ms,
    alone_capture_s, alone_pool_mib}; set_costs[name] = {capture_s, pool_mib}."""

    def __init__(self, model, options, context, warmup, iters, with_graphs, log):
        self.model, self.options, self.context = model, options, context
        self.warmup, self.iters, self.with_graphs, self.log = warmup, iters, with_graphs, log
        self.sizes: dict[int, dict] = {}
        self.set_costs: dict[str, dict] = {}
        self.set_sizes: dict[str, list[int]] = {}
        self.eager_llm = None
        self.base_seconds = self.base_bytes = 0.0

    def start(self) -> None:
        """The eager engine: built twice, the second time timed (the first pays one-off CUDA set-up)."""
        eager = dict(self.options, enforce_eager=True)
        _build(self.model, eager)
        release_memory()
        self.eager_llm, self.base_seconds, self.base_bytes = _build(self.model, eager)
        self.log(f"eager engine: start-up {self.base_seconds:.2f} s, {self.base_bytes / MiB:.0f} MiB")

    def stop(self) -> None:
        self.eager_llm = None
        release_memory()

    def measure_set(self, name: str, sizes: list[int]) -> None:
        new = [s for s in sizes if s not in self.sizes]
        self.set_sizes[name] = sorted(sizes)
        runner = self.eager_llm.engine.core.runner
        for s in new:  # eager timing first: it also compiles the kernels before any capture is timed
            self.sizes[s] = {"eager_ms": self._time(runner, s), "replay_ms": None,
                             "alone_capture_s": None, "alone_pool_mib": None}
        if not self.with_graphs:
            return
        for s in new:
            llm, seconds, grown = _build(self.model, dict(self.options, cudagraph_capture_sizes=[s]))
            self.sizes[s].update(alone_capture_s=seconds - self.base_seconds,
                                 alone_pool_mib=(grown - self.base_bytes) / MiB)
            llm = None  # noqa: F841 — freed before the next engine is built
            release_memory()
        self._measure_set_engine(name, sizes, new)

    def _measure_set_engine(self, name: str, sizes: list[int], new: list[int]) -> None:
        llm, seconds, grown = _build(self.model, dict(self.options, cudagraph_capture_sizes=sizes))
        runner = llm.engine.core.runner
        captured = list(runner.info.decode_graph_sizes)
        if captured != sorted(sizes):
            raise RuntimeError(f"asked for graphs of {sorted(sizes)} rows, the engine captured {captured}")
        for s in new:
            self.sizes[s]["replay_ms"] = self._time(runner, s)
        self.set_costs[name] = {"capture_s": seconds - self.base_seconds, "pool_mib": (grown - self.base_bytes) / MiB}
        self.log(f"{SET_NAMES[name]}: {len(sizes)} graphs, capture {self.set_costs[name]['capture_s']:.2f} s, "
                 f"pool {self.set_costs[name]['pool_mib']:.0f} MiB")
        runner = llm = None  # noqa: F841
        release_memory()

    def _time(self, runner, rows: int) -> float:
        """Median ms of one decode step of `rows` rows: the eager engine runs it eagerly, a graph engine replays."""
        return float(np.median(time_decode_step(runner, decode_batch(runner, rows, self.context), self.warmup,
                                                self.iters)))

    def step_ms(self, rows: int) -> float:
        """The step time the report uses for rows: the graph replay, or eager without graphs."""
        m = self.sizes[rows]
        return m["replay_ms"] if self.with_graphs else m["eager_ms"]

    def curve(self, sizes: list[int]) -> StepCurve:
        """The step curve fitted to these sizes, with their capture costs. Alone, a graph costs its
        engine's set-up too; in the powers-of-two engine the graphs after the first share that set-up
        and the pool, and what the set cost beyond its largest graph alone is spread over them."""
        step = {s: self.step_ms(s) for s in sizes}
        if not self.with_graphs:
            return StepCurve.fit(step)
        capture = {s: max(self.sizes[s]["alone_capture_s"], 0.0) for s in sizes}
        pool = {s: max(self.sizes[s]["alone_pool_mib"], 0.0) * MiB for s in sizes}
        pow2, costs = self.set_sizes["powers_of_two"], self.set_costs["powers_of_two"]
        others = max(len(pow2) - 1, 1)
        alone = [self.sizes[s]["alone_capture_s"] for s in pow2]
        shared_setup = max(sum(alone) - costs["capture_s"], 0.0) / others
        extra_pool = max(costs["pool_mib"] - self.sizes[pow2[-1]]["alone_pool_mib"], 0.0) * MiB / others
        extra_capture = {s: max(c - shared_setup, 0.0) for s, c in capture.items()}
        return StepCurve.fit(step, capture, pool, extra_capture_seconds=extra_capture,
                             extra_pool_bytes=LinearCost(extra_pool, 0.0))


def _set_summary(name: str, sizes: list[int], probe: _Probe, planning: StepCurve, final: StepCurve,
                 dist: BatchDistribution) -> dict:
    """Padding of one size set: measured (each bucket's own time), predicted (the planning curve)."""
    measured = lambda rows: np.array([probe.step_ms(int(r)) for r in rows])  # noqa: E731
    padded = expected_padded_ms(sizes, measured, dist)
    costs = probe.set_costs.get(name, {})
    return {
        "sizes": list(sizes), "num_sizes": len(sizes),
        "average_padded_rows": average_padded_rows(sizes, dist),
        "expected_padded_ms": padded,
        "waste_pct": 100 * (padded / expected_unpadded_ms(final, dist) - 1),
        "predicted_padded_ms": expected_padded_ms(sizes, planning, dist),
        "predicted_waste_pct": 100 * expected_waste(sizes, planning, dist),
        "capture_s": costs.get("capture_s"), "pool_mib": costs.get("pool_mib"),
        "predicted_capture_s": planning.capture_seconds_for(sizes) if probe.with_graphs else None,
        "predicted_pool_mib": planning.pool_bytes_for(sizes) / MiB if probe.with_graphs else None,
    }


def _captures_graphs(config: EngineConfig) -> bool:
    return config.device.startswith("cuda") and not config.enforce_eager


def _build(model: str, options: dict):
    """(engine, start-up seconds, bytes it added to torch.cuda.memory_reserved())."""
    on_cuda = str(options.get("device", "auto")) != "cpu" and torch.cuda.is_available()
    if on_cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_reserved() if on_cuda else 0
    start = time.perf_counter()
    llm = LLM(model, **options)
    if on_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if on_cuda:
        torch.cuda.empty_cache()  # what stays reserved is what the engine holds, not cached temporaries
    return llm, seconds, (torch.cuda.memory_reserved() - before if on_cuda else 0)


@contextlib.contextmanager
def _quiet_engine_logs():
    """The report builds dozens of engines; their start-up lines would bury its own."""
    logger = logging.getLogger("nanoserve")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _curve_json(curve: StepCurve) -> dict:
    costs = ("capture_seconds", "pool_bytes", "extra_capture_seconds", "extra_pool_bytes")
    return {"rows": list(curve.rows), "ms": list(curve.ms),
            **{k: None if getattr(curve, k) is None else vars(getattr(curve, k)) for k in costs}}


def format_report(report: dict) -> str:
    """The report as the command prints it: one row per size, then the two size sets."""
    s = report["settings"]
    lines = [f"{report['model']}: max_num_seqs {s['max_num_seqs']}, context {s['context']}, {s['device']}"
             + ("" if s["graphs"] else " (no CUDA graphs: eager timings only)"),
             f"{'rows':>5}  {'replay ms':>9}  {'eager ms':>9}  {'pool MiB':>8}  {'capture s':>9}  sets"]
    for r in report["sizes"]:
        lines.append(f"{r['rows']:>5}  {_fmt(r['replay_ms'], '.3f'):>9}  {_fmt(r['eager_ms'], '.3f'):>9}  "
                     f"{_fmt(r['alone_pool_mib'], '.1f'):>8}  {_fmt(r['alone_capture_s'], '.2f'):>9}  "
                     + ", ".join(SET_NAMES[k] for k in r["sets"]))
    lines.append(f"batch sizes: {s['distribution']} over 1..{s['max_num_seqs']} (mean {report['mean_rows']:.1f} "
                 f"rows; unpadded {report['unpadded_ms']:.3f} ms)")
    lines.append(f"{'':14} {'sizes':>5}  {'avg padded rows':>15}  {'padded ms':>9}  {'waste':>6}  "
                 f"{'capture s':>9}  {'pool MiB':>8}")
    for key, v in report["sets"].items():
        lines.append(f"{SET_NAMES[key]:14} {v['num_sizes']:>5}  {v['average_padded_rows']:>15.1f}  "
                     f"{v['expected_padded_ms']:>9.3f}  {v['waste_pct']:>5.1f}%  {_fmt(v['capture_s'], '.2f'):>9}  "
                     f"{_fmt(v['pool_mib'], '.0f'):>8}")
    lines.append(f"plan: {report['sets']['plan']['sizes']}")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot_reports(reports: list[dict], path: str | Path) -> Path:
    """Step time against rows, one panel per report: the fitted curve, measured points, and each set's
    padded step time t(bucket(b)) as a staircase with its sizes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6.5 * len(reports), 4.8), squeeze=False)
    for ax, report in zip(axes[0], reports):
        _plot_one(ax, report)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_one(ax, report: dict) -> None:
    n, graphs = report["settings"]["max_num_seqs"], report["settings"]["graphs"]
    rows = np.arange(1, n + 1)
    curve = StepCurve(tuple(report["curve"]["rows"]), tuple(report["curve"]["ms"]))
    step = {r["rows"]: r["replay_ms"] if graphs else r["eager_ms"] for r in report["sizes"]}
    ax.plot(rows, curve(rows), color="0.6", lw=1, label="fitted step time t(b)")
    for (key, v), color in zip(report["sets"].items(), ("tab:red", "tab:blue")):
        sizes = v["sizes"]
        padded = [step[int(s)] for s in buckets(sizes, n)]
        ax.step(rows, padded, where="pre", color=color, lw=1.4,
                label=f"{SET_NAMES[key]} ({len(sizes)} sizes): waste {v['waste_pct']:.1f}%")
        ax.plot(sizes, [step[int(s)] for s in sizes], "o", color=color, ms=4)
    if graphs:
        eager = sorted((r["rows"], r["eager_ms"]) for r in report["sizes"])
        ax.plot(*zip(*eager), "x", color="0.4", ms=4, label="eager forward")
    ax.set_xlabel("decode rows b")
    ax.set_ylabel("ms per decode step" + (" (graph replay)" if graphs else " (eager)"))
    ax.set_title(f"{Path(report['model']).name} · {report['settings']['distribution']} batch sizes · "
                 f"context {report['settings']['context']}", fontsize=10)
    ax.set_xlim(0, n + 1)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


__all__ = ["run_graphs_report", "format_report", "plot_reports", "report_engine_options", "load_distribution"]
