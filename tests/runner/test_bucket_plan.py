"""The bucket planner (pure, CPU): curve fitting, batch histograms, and the plan against brute force,
budgets, and powers of two on the H200's measured replay times."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from nanoserve.bench.padding import average_padded_rows, buckets, expected_padded_ms, expected_unpadded_ms, expected_waste
from nanoserve.runner.startup.bucket_plan import BatchDistribution, LinearCost, StepCurve, plan_buckets

MiB = 2**20
# Graph replay ms on the H200 (benchmarks/results/decode_latency.json, context 512, bf16).
QWEN3_0_6B_H200 = {1: 1.00, 8: 1.25, 32: 1.71, 64: 2.19, 128: 3.05, 256: 5.10}
LLAMA_3_1_8B_H200 = {1: 4.26, 32: 5.35, 64: 5.99, 256: 10.68}
# Capturing the 9 powers of two took 1.8 s (Qwen3) and 2.1 s (Llama) with pools of 168 / 160 MiB.
H200_CAPTURE = LinearCost(0.2, 0.0002)
H200_POOL = LinearCost(8 * MiB, 0.6 * MiB)
H200_EXTRA_POOL = LinearCost(2 * MiB, 0.0)  # graphs after the first reuse its pool
POWERS_OF_TWO_256 = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def h200_curve(points) -> StepCurve:
    return StepCurve.fit(points, capture_seconds=H200_CAPTURE, pool_bytes=H200_POOL, extra_pool_bytes=H200_EXTRA_POOL)


def random_case(rng: np.random.Generator, n: int):
    """A monotone random curve with random per-graph costs, and a random distribution."""
    rows = np.unique(np.concatenate([[1, n], rng.integers(1, n + 1, size=4)]))
    ms = np.cumsum(rng.uniform(0.0, 2.0, size=len(rows))) + 1.0
    curve = StepCurve.fit(dict(zip(rows.tolist(), ms.tolist())),
                          capture_seconds=LinearCost(rng.uniform(0.05, 0.3), rng.uniform(0, 0.002)),
                          pool_bytes=LinearCost(rng.uniform(1, 20) * MiB, rng.uniform(0, 1) * MiB),
                          extra_capture_seconds=LinearCost(rng.uniform(0.02, 0.2), rng.uniform(0, 0.001)),
                          extra_pool_bytes=LinearCost(rng.uniform(0, 10) * MiB, rng.uniform(0, 0.5) * MiB))
    counts = rng.integers(0, 5, size=n) * (rng.uniform(size=n) < 0.5)
    return curve, BatchDistribution(counts)


# ------------------------------------------------------------------------------------- StepCurve
def test_curve_interpolates_and_extrapolates_linearly():
    curve = StepCurve.fit({1: 1.0, 8: 1.0, 16: 2.0, 32: 6.0})
    assert curve(1) == 1.0 and curve(4) == 1.0 and curve(12) == pytest.approx(1.5)
    assert curve(24) == pytest.approx(4.0)
    assert curve(0.5) == 1.0  # flat below the first point
    assert curve(40) == pytest.approx(8.0)  # the last segment's slope beyond the last point
    np.testing.assert_allclose(curve(np.array([1, 12, 24])), [1.0, 1.5, 4.0])


def test_tabulated_curve_is_the_curve():
    """The draft plan's per-row lookup: the curve's values at whole row counts, the curve itself beyond the table or at
    fractional rows."""
    curve = StepCurve.fit({1: 1.0, 8: 1.0, 16: 2.0, 32: 6.0})
    table = curve.tabulated(20)
    rows = np.arange(0, 41)
    np.testing.assert_allclose(table(rows[:21]), curve(rows[:21]))
    np.testing.assert_allclose(table(rows), curve(rows))  # (past the table: computed)
    np.testing.assert_allclose(table(np.array([12.5])), curve(np.array([12.5])))
    assert table(np.array([], np.int64)).shape == (0,)


def test_curve_fit_is_monotone_and_averages_repeats():
    curve = StepCurve.fit([(1, 1.0), (2, 1.2), (4, 1.1), (8, 2.0), (8, 2.2)])  # noise: 4 rows faster than 2
    assert curve.rows == (1, 2, 4, 8)
    assert curve.ms == pytest.approx((1.0, 1.15, 1.15, 2.1))  # the violating pair pooled; repeats averaged
    assert np.all(np.diff(curve(np.arange(1, 20))) >= 0)


@pytest.mark.parametrize("points", [{}, {0: 1.0}, {1: float("nan")}])
def test_curve_rejects_bad_points(points):
    with pytest.raises(ValueError, match="point"):
        StepCurve.fit(points)


def test_curve_rejects_non_monotone_direct_construction():
    with pytest.raises(ValueError, match="non-decreasing"):
        StepCurve(rows=(1, 2), ms=(2.0, 1.0))


def test_linear_cost_fit():
    exact = LinearCost.fit({1: 0.201, 101: 0.301, 201: 0.401})
    assert exact.fixed == pytest.approx(0.2) and exact.per_row == pytest.approx(0.001)
    assert LinearCost.fit({64: 5.0}) == LinearCost(5.0, 0.0)  # one point: a constant
    falling = LinearCost.fit({1: 3.0, 2: 1.0})
    assert falling.per_row == 0 and falling.fixed == pytest.approx(2.0)  # costs never fall with rows
    through_origin = LinearCost.fit({10: 1.0, 20: 3.0})  # the best line has a negative intercept
    assert through_origin.fixed == 0 and through_origin.per_row == pytest.approx(0.14)
    with pytest.raises(ValueError, match="non-negative"):
        LinearCost(-1.0, 0.0)


def test_set_costs_are_the_largest_graph_plus_the_extras():
    curve = StepCurve.fit({1: 1.0}, capture_seconds=LinearCost(0.3, 0.01), pool_bytes=LinearCost(100, 10),
                          extra_capture_seconds=LinearCost(0.1, 0.01), extra_pool_bytes=LinearCost(1, 0))
    assert curve.capture_seconds_for([4, 16, 4]) == pytest.approx(0.3 + 0.16 + 0.1 + 0.04)
    assert curve.pool_bytes_for([4, 16]) == pytest.approx(100 + 160 + 1)
    unshared = StepCurve.fit({1: 1.0}, capture_seconds={1: 0.2}, pool_bytes=LinearCost(100, 10))  # no extras
    assert unshared.capture_seconds_for([4, 16]) == pytest.approx(0.4)
    assert unshared.pool_bytes_for([4, 16]) == pytest.approx(140 + 260)


# ------------------------------------------------------------------------------ BatchDistribution
def test_uniform_and_recorded_probabilities():
    np.testing.assert_allclose(BatchDistribution.uniform(4).probabilities(), [0.25] * 4)
    hist = BatchDistribution.empty(4)
    np.testing.assert_allclose(hist.probabilities(), [0.25] * 4)  # nothing recorded: plan as uniform
    hist.record(1)
    hist.record(3, steps=3)
    np.testing.assert_allclose(hist.probabilities(), [0.25, 0, 0.75, 0])
    for bad in (0, 5):
        with pytest.raises(ValueError, match="outside 1..4"):
            hist.record(bad)


def test_histogram_round_trips_through_the_file(tmp_path):
    hist = BatchDistribution.empty(8)
    for b in (1, 1, 2, 8, 5, 5, 5):
        hist.record(b)
    path = tmp_path / "plan.json"
    hist.save(path)
    data = json.loads(path.read_text())
    assert data == {"format": "nanoserve-batch-histogram", "version": 1, "max_num_seqs": 8,
                    "counts": [2, 1, 0, 0, 3, 0, 0, 1]}
    loaded = BatchDistribution.load(path)
    assert loaded.max_num_seqs == 8
    np.testing.assert_array_equal(loaded.counts, hist.counts)
    np.testing.assert_allclose(loaded.probabilities(), hist.probabilities())
    assert not (tmp_path / "plan.json.tmp").exists()
    weighted = BatchDistribution([0.5, 0.25, 1.5])
    weighted.save(path)
    np.testing.assert_allclose(BatchDistribution.load(path).counts, [0.5, 0.25, 1.5])


def test_histogram_for_another_max_num_seqs_is_resized(tmp_path):
    path = tmp_path / "h.json"
    BatchDistribution([1, 2, 3, 4, 5, 6]).save(path)
    smaller = BatchDistribution.load(path, max_num_seqs=4)  # steps above 4 rows would now run 4 rows
    np.testing.assert_array_equal(smaller.counts, [1, 2, 3, 4 + 5 + 6])
    larger = BatchDistribution.load(path, max_num_seqs=8)  # never seen above 6: no weight
    np.testing.assert_array_equal(larger.counts, [1, 2, 3, 4, 5, 6, 0, 0])
    assert plan_buckets(StepCurve.fit({1: 1.0, 8: 8.0}), larger, 8)[-1] == 8  # still always captured


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read"),
    ('{"counts": [1]}', "not a nanoserve batch histogram"),
    ('{"format": "nanoserve-batch-histogram", "version": 9, "max_num_seqs": 1, "counts": [1]}', "version 9"),
    ('{"format": "nanoserve-batch-histogram", "version": 1, "max_num_seqs": 2, "counts": [1]}', "counts"),
    ('{"format": "nanoserve-batch-histogram", "version": 1, "max_num_seqs": 2, "counts": [1, -1]}', "counts"),
])
def test_bad_histogram_files_are_one_clear_line(tmp_path, content, message):
    path = tmp_path / "h.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        BatchDistribution.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_missing_histogram_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the batch histogram"):
        BatchDistribution.load(tmp_path / "absent.json")


# ---------------------------------------------------------------------------------- expectations
def test_expectations_match_direct_sums():
    curve = StepCurve.fit({1: 1.0, 8: 2.0, 16: 6.0})
    dist = BatchDistribution([3, 0, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4])
    sizes = [2, 6, 16]
    assert buckets(sizes, 16).tolist() == [2, 2] + [6] * 4 + [16] * 10
    p = dist.probabilities()
    bucket = lambda b: min(s for s in sizes if s >= b)  # noqa: E731
    padded = sum(p[b - 1] * float(curve(bucket(b))) for b in range(1, 17))
    unpadded = sum(p[b - 1] * float(curve(b)) for b in range(1, 17))
    assert expected_padded_ms(sizes, curve, dist) == pytest.approx(padded)
    assert expected_unpadded_ms(curve, dist) == pytest.approx(unpadded)
    assert expected_waste(sizes, curve, dist) == pytest.approx(padded / unpadded - 1)
    assert average_padded_rows(sizes, dist) == pytest.approx(sum(p[b - 1] * bucket(b) for b in range(1, 17)))
    assert expected_waste(range(1, 17), curve, dist) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="include max_num_seqs"):
        expected_padded_ms([2, 8], curve, dist)


# ------------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("seed", range(6))
def test_plan_with_k_sizes_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    n = 9
    curve, dist = random_case(rng, n)
    for k in (1, 2, 3, 4):
        plan = plan_buckets(curve, dist, n, capture_budget_s=1e9, pool_budget_bytes=1e18, min_relative_gain=0.0,
                            max_sizes=k)
        best = min(expected_padded_ms(list(c) + [n], curve, dist) for c in itertools.combinations(range(1, n), k - 1))
        assert plan[-1] == n and len(plan) <= k
        assert expected_padded_ms(plan, curve, dist) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_budgets_are_respected_and_a_larger_budget_is_never_worse(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(8, 200))
    curve, dist = random_case(rng, n)
    floor_s, floor_pool = curve.capture_seconds_for([n]), curve.pool_bytes_for([n])
    pool_share, previous = rng.uniform(0.1, 1.0), None
    for scale in (1.0, 1.5, 2.5, 4.0, 8.0, 100.0):  # both budgets grow
        budget_s, budget_pool = floor_s * scale, floor_pool * (1 + (scale - 1) * pool_share)
        plan = plan_buckets(curve, dist, n, capture_budget_s=budget_s, pool_budget_bytes=budget_pool)
        assert plan == sorted(set(plan)) and plan[-1] == n
        assert curve.capture_seconds_for(plan) <= budget_s
        assert curve.pool_bytes_for(plan) <= budget_pool
        ms = expected_padded_ms(plan, curve, dist)
        if previous is not None:
            assert ms <= previous + 1e-12
        previous = ms


def test_a_flat_curve_gives_few_sizes_and_a_linear_one_more():
    dist = BatchDistribution.uniform(256)
    flat = StepCurve.fit({1: 2.0, 256: 2.0}, capture_seconds=H200_CAPTURE)
    assert plan_buckets(flat, dist, 256) == [256]
    nearly_flat = StepCurve.fit({1: 2.0, 256: 2.02}, capture_seconds=H200_CAPTURE)
    assert len(plan_buckets(nearly_flat, dist, 256)) <= 2
    linear = StepCurve.fit({1: 1.0, 256: 256.0}, capture_seconds=H200_CAPTURE)
    plan = plan_buckets(linear, dist, 256)
    assert len(plan) >= 10
    gaps = np.diff([0] + plan)
    assert gaps.max() - gaps.min() <= 2  # a linear curve under a uniform load: evenly spaced sizes


def test_max_num_seqs_is_always_in_the_plan():
    curve = h200_curve(QWEN3_0_6B_H200)
    small_only = BatchDistribution.empty(256)
    small_only.record(3, steps=100)
    assert plan_buckets(curve, small_only, 256)[-1] == 256
    assert plan_buckets(curve, small_only, 256, candidates=[2, 3, 5])[-1] == 256
    assert plan_buckets(curve, BatchDistribution.uniform(256), 256, max_sizes=1) == [256]


def test_a_recorded_histogram_puts_sizes_where_the_batches_are():
    hist = BatchDistribution.empty(256)
    hist.record(3, steps=50)
    hist.record(100, steps=50)
    assert plan_buckets(h200_curve(QWEN3_0_6B_H200), hist, 256) == [3, 100, 256]


def test_the_largest_graph_alone_over_budget_is_a_clear_error():
    curve = StepCurve.fit({1: 1.0, 256: 5.0}, pool_bytes=LinearCost(0, 8 * MiB))  # 2 GiB at 256 rows
    with pytest.raises(ValueError, match="256 rows alone needs .* 2048 MiB of pool"):
        plan_buckets(curve, BatchDistribution.uniform(256), 256)  # (the default budget: the engine's 1024 MiB)


@pytest.mark.parametrize("name, points", [("Qwen3-0.6B", QWEN3_0_6B_H200), ("Llama-3.1-8B", LLAMA_3_1_8B_H200)])
def test_plan_beats_powers_of_two_on_the_h200_curves(name, points):
    curve, dist = h200_curve(points), BatchDistribution.uniform(256)
    plan = plan_buckets(curve, dist, 256)
    plan_waste, pow2_waste = expected_waste(plan, curve, dist), expected_waste(POWERS_OF_TWO_256, curve, dist)
    assert plan_waste <= 0.03, (name, plan, plan_waste)
    assert plan_waste < pow2_waste
    assert pow2_waste > 0.10  # the point: powers of two waste over a tenth of the step at these shapes
    assert average_padded_rows(plan, dist) < average_padded_rows(POWERS_OF_TWO_256, dist)
    assert curve.capture_seconds_for(plan) <= 5.0 and curve.pool_bytes_for(plan) <= 512 * MiB
    assert plan[0] > 1  # the flat start needs no graph of its own: 1..plan[0] rows cost about the same


def test_plan_is_fast_at_1024_rows():
    curve = StepCurve.fit({1: 1.0, 64: 1.5, 1024: 40.0}, capture_seconds=H200_CAPTURE)
    plan = plan_buckets(curve, BatchDistribution.uniform(1024), 1024)
    assert plan[-1] == 1024 and curve.capture_seconds_for(plan) <= 5.0
