"""What padding to a size set costs, for a batch-size distribution: the figures `nanoserve bench graphs` reports
for the powers of two and the plan (the engine plans with runner/bucket_plan.py and needs none of these)."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from nanoserve.runner.dispatch import bucket_for
from nanoserve.runner.startup.bucket_plan import BatchDistribution, StepTime


def buckets(sizes: Iterable[int], max_num_seqs: int) -> np.ndarray:
    """bucket(b) for b = 1..max_num_seqs (sizes must reach max_num_seqs)."""
    ordered = sorted({int(s) for s in sizes})
    if not ordered or ordered[0] < 1 or ordered[-1] < max_num_seqs:
        raise ValueError(f"capture sizes {ordered} must be positive and include max_num_seqs={max_num_seqs}")
    return np.array([bucket_for(ordered, b) for b in range(1, max_num_seqs + 1)], dtype=np.int64)


def expected_padded_ms(sizes: Iterable[int], curve: StepTime, distribution: BatchDistribution) -> float:
    """E_b[t(bucket(b))]: the mean decode step time when every batch replays its bucket."""
    p = distribution.probabilities()
    return float(p @ np.asarray(curve(buckets(sizes, distribution.max_num_seqs)), dtype=np.float64))


def expected_unpadded_ms(curve: StepTime, distribution: BatchDistribution) -> float:
    """E_b[t(b)]: the mean step time with a graph for every size (no padding)."""
    rows = np.arange(1, distribution.max_num_seqs + 1)
    return float(distribution.probabilities() @ np.asarray(curve(rows), dtype=np.float64))


def expected_waste(sizes: Iterable[int], curve: StepTime, distribution: BatchDistribution) -> float:
    """Padding's share of the step time: E[t(bucket(b))] / E[t(b)] − 1 (0.03 is 3%)."""
    return expected_padded_ms(sizes, curve, distribution) / expected_unpadded_ms(curve, distribution) - 1.0


def average_padded_rows(sizes: Iterable[int], distribution: BatchDistribution) -> float:
    """E_b[bucket(b)]: the rows a step computes on average, padding included (compare E[b])."""
    return float(distribution.probabilities() @ buckets(sizes, distribution.max_num_seqs))


__all__ = ["buckets", "expected_padded_ms", "expected_unpadded_ms", "expected_waste", "average_padded_rows"]
