"""The GEMV sweep of benchmarks/gemv.py: which variants it times (host-side logic, no kernel)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/

from benchmarks import gemv as sweep  # noqa: E402


def test_sweep_times_each_distinct_launch_once():
    for m, want in ((1, {False}), (2, {False, True}), (16, {True})):
        variants = sweep.configs_for(m, 1024, 2048)
        assert {c.use_dot for c in variants} == want
        keys = [sweep.launch_key(c, m, 1024, 2048, 132) for c in variants]
        assert len(keys) == len(set(keys)), "variants must differ"
        every = {sweep.launch_key(c, m, 1024, 2048, 132) for c in sweep.sweep_configs(m)}
        assert set(keys) == every, "each swept launch is timed once"
