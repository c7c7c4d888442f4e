"""CUDA-graph bucket planning: which decode batch sizes get a graph, chosen from measurements.

A decode batch of b rows replays the smallest captured size ≥ b, so it pays t(bucket(b)) rather
than t(b). Powers of two make that padding up to ~2× the rows; while the step is weight-bound the
padding is free, past that it is not (H200, Qwen3-0.6B: 3.05 ms at 128 rows, 5.10 ms at 256, so
a batch of 129 pays 67% more than it needs). This module is pure (no GPU): a fitted step-time curve
(`StepCurve`), a batch-size distribution (`BatchDistribution`, uniform or recorded while serving)
and `plan_buckets`, the set of sizes minimising the expected padded step time under a capture-time
and a graph-pool budget. The runner measures; this module decides.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanoserve.config import CUDAGRAPH_CAPTURE_BUDGET_S, CUDAGRAPH_POOL_BUDGET_MIB

# Stop adding sizes once one more would cut the expected padded step time by less than this
# fraction (0.1%). Each graph costs ~0.2 s of start-up and some pool memory; below 0.1% the gain
# is inside run-to-run timing noise, so a flat curve ends with 1-2 sizes and a steep one with tens.
MIN_RELATIVE_GAIN = 1e-3
DEFAULT_CAPTURE_BUDGET_S = CUDAGRAPH_CAPTURE_BUDGET_S
DEFAULT_POOL_BUDGET_BYTES = CUDAGRAPH_POOL_BUDGET_MIB * 2**20

StepTime = Callable[[np.ndarray], np.ndarray]  # rows → ms per decode step


@dataclass(frozen=True)
class LinearCost:
    """fixed + per_row × rows (both ≥ 0): the capture seconds or pool bytes of one graph."""

    fixed: float = 0.0
    per_row: float = 0.0

    def __post_init__(self) -> None:
        if not (self.fixed >= 0 and self.per_row >= 0 and math.isfinite(self.fixed + self.per_row)):
            raise ValueError(f"a cost needs finite, non-negative terms, got {self}")

    def __call__(self, rows):
        return self.fixed + self.per_row * np.asarray(rows, dtype=np.float64)

    @classmethod
    def fit(cls, points: Mapping[int, float] | Iterable[tuple[int, float]]) -> "LinearCost":
        """Least-squares line through (rows, value) points, with both terms kept ≥ 0.
        One point (or one distinct row count) gives a constant."""
        rows, values = _points(points, "cost")
        if len(set(rows.tolist())) == 1:
            return cls(max(float(values.mean()), 0.0), 0.0)
        per_row, fixed = np.polyfit(rows, values, 1)
        if per_row < 0:  # costs do not fall with rows: the best constant
            return cls(max(float(values.mean()), 0.0), 0.0)
        if fixed < 0:  # the best line through the origin
            return cls(0.0, max(float(rows @ values / (rows @ rows)), 0.0))
        return cls(float(fixed), float(per_row))


@dataclass(frozen=True)
class StepCurve:
    """Decode step time (ms) against rows, plus what one graph of r rows costs to capture.

    ms(r) interpolates the measured points linearly after a monotone (isotonic) fit: flat below the
    first point, the last segment's slope beyond the last. That is adequate because a decode step is
    a weight read that does not grow with rows plus per-row work (KV reads, activations, GEMM compute
    once the GEMMs leave the bandwidth-bound range) that grows about linearly; kernel switches only
    change the slope at a few row counts. Between probes at 1, 8, 32, 64, 128, 256 the chord is
    within a few percent of the curve, and the planner needs only the relative cost of neighbouring
    sizes. The monotone fit absorbs timing noise: a step never gets cheaper with more rows.

    Graphs are captured largest first (max_num_seqs) into one shared pool. capture_seconds(r) and
    pool_bytes(r) are what that first graph costs, one-off set-up included; each further, smaller
    graph adds extra_capture_seconds(r) and extra_pool_bytes(r) (it reuses the pool the first one
    grew). The extras default to the first graph's costs: no sharing, an upper bound.
    """

    rows: tuple[int, ...]
    ms: tuple[float, ...]
    capture_seconds: LinearCost = LinearCost()
    pool_bytes: LinearCost = LinearCost()
    extra_capture_seconds: LinearCost | None = None
    extra_pool_bytes: LinearCost | None = None

    def __post_init__(self) -> None:
        r, t = np.asarray(self.rows), np.asarray(self.ms, dtype=np.float64)
        if len(r) == 0 or len(r) != len(t):
            raise ValueError(f"a step curve needs matching, non-empty rows and ms, got {self.rows} and {self.ms}")
        if r[0] < 1 or np.any(np.diff(r) <= 0):
            raise ValueError(f"curve rows must be positive and strictly increasing, got {self.rows}")
        if not np.all(np.isfinite(t)) or t[0] <= 0 or np.any(np.diff(t) < 0):
            raise ValueError(f"curve ms must be positive, finite and non-decreasing, got {self.ms}")

    @classmethod
    def fit(cls, step_ms: Mapping[int, float] | Iterable[tuple[int, float]], capture_seconds=(), pool_bytes=(),
            extra_capture_seconds=None, extra_pool_bytes=None) -> "StepCurve":
        """A curve from measured (rows, ms) points (repeats are averaged) and per-graph costs, each a
        LinearCost or (rows, value) points to fit one to (empty: free; an extra left None: no sharing)."""
        rows, ms = _points(step_ms, "step time")
        unique, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
        means = np.bincount(inverse, weights=ms) / counts
        fitted = _isotonic(means, counts.astype(np.float64))
        extras = [None if e is None else _as_cost(e) for e in (extra_capture_seconds, extra_pool_bytes)]
        return cls(tuple(int(r) for r in unique), tuple(float(t) for t in fitted),
                   _as_cost(capture_seconds), _as_cost(pool_bytes), *extras)

    def __call__(self, rows):
        """ms per step at `rows` (a number or an array of row counts)."""
        r = np.asarray(rows, dtype=np.float64)
        xs, ys = np.asarray(self.rows, dtype=np.float64), np.asarray(self.ms)
        out = np.interp(r, xs, ys)
        if len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(r > xs[-1], ys[-1] + slope * (r - xs[-1]), out)
        return out

    def tabulated(self, upto: int) -> StepTime:
        """The same curve as a lookup over whole row counts 0..upto (beyond: computed): the draft plan evaluates
        curves every step, where np.interp's set-up costs more than the plan's own arithmetic."""
        table = np.asarray(self(np.arange(upto + 1)), np.float64)

        def ms(rows):
            r = np.asarray(rows)
            return table[r] if r.dtype.kind in "iu" and r.size and 0 <= r.min() and r.max() <= upto else self(r)
        return ms

    def capture_seconds_for(self, sizes: Iterable[int]) -> float:
        """Seconds to warm up and capture the sizes, largest first."""
        return _set_cost(sizes, self.capture_seconds, self.extra_capture_seconds)

    def pool_bytes_for(self, sizes: Iterable[int]) -> float:
        """Pool bytes of the sizes captured largest first into one shared pool."""
        return _set_cost(sizes, self.pool_bytes, self.extra_pool_bytes)


class BatchDistribution:
    """How often a decode step has b rows, b = 1..max_num_seqs: uniform, or a recorded histogram.

    counts[b - 1] is the weight of b rows (decode steps seen, for a recording). The file is JSON:
    {"format": "nanoserve-batch-histogram", "version": 1, "max_num_seqs": N, "counts": [c_1, …, c_N]}.
    A histogram with nothing recorded plans as uniform: nothing has been learned yet.
    """

    FORMAT = "nanoserve-batch-histogram"
    VERSION = 1

    def __init__(self, counts: Iterable[float]):
        c = np.array(list(counts), dtype=np.float64)
        if c.ndim != 1 or len(c) == 0 or not np.all(np.isfinite(c)) or np.any(c < 0):
            raise ValueError("batch counts must be a non-empty list of finite, non-negative numbers")
        self.counts = c

    @classmethod
    def uniform(cls, max_num_seqs: int) -> "BatchDistribution":
        return cls(np.ones(_check_max(max_num_seqs)))

    @classmethod
    def empty(cls, max_num_seqs: int) -> "BatchDistribution":
        """A histogram to record() into while serving."""
        return cls(np.zeros(_check_max(max_num_seqs)))

    @property
    def max_num_seqs(self) -> int:
        return len(self.counts)

    def record(self, batch_size: int, steps: int = 1) -> None:
        if not 1 <= batch_size <= self.max_num_seqs:
            raise ValueError(f"batch size {batch_size} is outside 1..{self.max_num_seqs}")
        self.counts[batch_size - 1] += steps

    def probabilities(self) -> np.ndarray:
        """p[b - 1] = P(a step has b rows); uniform when nothing was recorded."""
        total = self.counts.sum()
        if total == 0:
            return np.full(self.max_num_seqs, 1.0 / self.max_num_seqs)
        return self.counts / total

    def resized(self, max_num_seqs: int) -> "BatchDistribution":
        """The distribution for an engine with another max_num_seqs. Weight above the new limit moves
        onto it (those steps would now run max_num_seqs rows, the rest waiting); sizes above the
        recorded limit get no weight (never seen; max_num_seqs is always captured, so they still
        have a graph)."""
        n = _check_max(max_num_seqs)
        if n == self.max_num_seqs:
            return BatchDistribution(self.counts)
        counts = np.zeros(n)
        keep = min(n, self.max_num_seqs)
        counts[:keep] = self.counts[:keep]
        counts[n - 1] += self.counts[keep:].sum()
        return BatchDistribution(counts)

    def save(self, path: str | Path) -> None:
        """Write the histogram as JSON (atomically: a crash mid-write keeps the old file)."""
        path = Path(path)
        counts = [int(c) if float(c).is_integer() else float(c) for c in self.counts]
        data = {"format": self.FORMAT, "version": self.VERSION, "max_num_seqs": self.max_num_seqs, "counts": counts}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, max_num_seqs: int | None = None) -> "BatchDistribution":
        """Read a histogram file; with max_num_seqs, resized() to it. Bad files: one-line ValueError."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the batch histogram {str(path)!r}: {e}") from None
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            raise ValueError(f"{str(path)!r} is not a nanoserve batch histogram (no \"format\": \"{cls.FORMAT}\")")
        if data.get("version") != cls.VERSION:
            raise ValueError(f"batch histogram {str(path)!r} has version {data.get('version')!r}; "
                             f"this nanoserve reads version {cls.VERSION}")
        counts, n = data.get("counts"), data.get("max_num_seqs")
        if not isinstance(counts, list) or n != len(counts) or not all(_is_count(c) for c in counts):
            raise ValueError(f"batch histogram {str(path)!r} needs \"counts\": max_num_seqs non-negative numbers")
        dist = cls(counts)
        return dist if max_num_seqs is None else dist.resized(max_num_seqs)


def plan_buckets(curve: StepCurve, distribution: BatchDistribution, max_num_seqs: int,
                 capture_budget_s: float = DEFAULT_CAPTURE_BUDGET_S,
                 pool_budget_bytes: float = DEFAULT_POOL_BUDGET_BYTES,
                 min_relative_gain: float = MIN_RELATIVE_GAIN, candidates: Iterable[int] | None = None,
                 max_sizes: int | None = None) -> list[int]:
    """The capture sizes (ascending, always ending with max_num_seqs) minimising the expected padded
    step time E_b[t(bucket(b))] under both budgets.

    For each count k, dynamic programming over the sorted candidates gives the exact best k sizes
    (O(k·m²) for m candidates). k grows while one more size gains at least min_relative_gain of the
    expected time and the cheapest k-set could still fit; the answer is the best k-optimum within the
    budgets. With per-graph costs that grow with rows a set of k other sizes might fit where the
    k-optimum does not; measured costs are nearly constant per graph, so this is rarely a loss.
    A larger budget never gives a worse plan: the k-optima do not depend on it.
    """
    n = _check_max(max_num_seqs)
    p = distribution.resized(n).probabilities()
    cand = _candidates(candidates, n)
    fits = lambda sizes: (curve.capture_seconds_for(sizes) <= capture_budget_s  # noqa: E731
                          and curve.pool_bytes_for(sizes) <= pool_budget_bytes)
    if not fits([n]):
        raise ValueError(
            f"a CUDA graph of {n} rows alone needs {curve.capture_seconds_for([n]):.2f} s to capture and "
            f"{curve.pool_bytes_for([n]) / 2**20:.0f} MiB of pool, over the budgets ({capture_budget_s} s, "
            f"{pool_budget_bytes / 2**20:.0f} MiB); raise them or lower max_num_seqs")
    cum = np.concatenate([[0.0], np.cumsum(p)])[cand]  # P(b ≤ c_j)
    t = np.asarray(curve(cand), dtype=np.float64)
    cost = t * cum  # best cost of covering b ≤ c_j with one size, c_j
    expected, parents = [cost[-1]], []
    limit = len(cand) if max_sizes is None else min(max_sizes, len(cand))
    while len(expected) < limit and fits(np.concatenate([[n], cand[:len(expected)]])):
        better, parent = _add_one_size(cost, t, cum)
        if expected[-1] - better[-1] < min_relative_gain * expected[-1]:
            break
        cost = better
        expected.append(better[-1])
        parents.append(parent)
    for k in range(len(expected), 0, -1):  # expected time falls with k: the largest k that fits
        sizes = _backtrack(cand, parents[:k - 1])
        if fits(sizes):
            return sizes
    raise AssertionError("unreachable: [max_num_seqs] alone fits")  # pragma: no cover


def _add_one_size(cost: np.ndarray, t: np.ndarray, cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One DP step: best[j] = min over i < j of cost[i] + t[j]·(cum[j] − cum[i]) (c_i the size below c_j)."""
    m = len(cost)
    inner = cost[:, None] - cum[:, None] * t[None, :]
    inner[np.tril_indices(m)] = np.inf  # i must be < j
    parent = inner.argmin(axis=0)
    best = inner[parent, np.arange(m)] + t * cum
    best[0] = np.inf  # the smallest candidate has nothing below it
    return best, parent


def _backtrack(cand: np.ndarray, parents: list[np.ndarray]) -> list[int]:
    j = len(cand) - 1
    sizes = [int(cand[j])]
    for parent in reversed(parents):
        j = int(parent[j])
        sizes.append(int(cand[j]))
    return sorted(sizes)


def _set_cost(sizes: Iterable[int], first: LinearCost, extra: LinearCost | None) -> float:
    ordered = sorted({int(s) for s in sizes})
    return float(first(ordered[-1]) + np.sum((extra or first)(ordered[:-1])))


def _candidates(candidates: Iterable[int] | None, n: int) -> np.ndarray:
    if candidates is None:
        return np.arange(1, n + 1)
    chosen = {int(c) for c in candidates if 1 <= c <= n} | {n}
    return np.array(sorted(chosen))


def _points(points, what: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = list(points.items()) if isinstance(points, Mapping) else [tuple(p) for p in points]
    if not pairs:
        raise ValueError(f"need at least one measured {what} point")
    rows = np.array([r for r, _ in pairs], dtype=np.float64)
    values = np.array([v for _, v in pairs], dtype=np.float64)
    if np.any(rows < 1) or not np.all(np.isfinite(values)):
        raise ValueError(f"{what} points need rows ≥ 1 and finite values, got {pairs}")
    return rows, values


def _as_cost(cost) -> LinearCost:
    if isinstance(cost, LinearCost):
        return cost
    pairs = list(cost.items()) if isinstance(cost, Mapping) else list(cost)
    return LinearCost.fit(pairs) if pairs else LinearCost()


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, points]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.repeat([b[0] for b in blocks], [int(b[2]) for b in blocks])


def _check_max(max_num_seqs: int) -> int:
    if not isinstance(max_num_seqs, (int, np.integer)) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
    return int(max_num_seqs)


def _is_count(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0


__all__ = ["LinearCost", "StepCurve", "BatchDistribution", "plan_buckets", "MIN_RELATIVE_GAIN", "StepTime",
           "DEFAULT_CAPTURE_BUDGET_S", "DEFAULT_POOL_BUDGET_BYTES"]
