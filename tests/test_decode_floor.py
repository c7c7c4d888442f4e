"""The pure parts of benchmarks/decode_floor.py: kernel kinds and the time attributed to them."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/

from benchmarks import decode_floor as pd  # noqa: E402


def test_kernel_kinds():
    assert pd.kernel_kind("_gemv_kernel") == "gemv"
    assert pd.kernel_kind("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT") == "gemv"  # cuBLAS
    assert pd.kernel_kind("_decode_reduce_kernel") == "attention merge"
    assert pd.kernel_kind("_qk_norm_rope_kernel") == "rotary" and pd.kernel_kind("_rms_norm_kernel") == "norm"
    assert pd.kernel_kind("void at::native::indexSelectSmallIndex<c10::BFloat16>") == "other"


def test_kind_table_attributes_overlapping_kernels_once():
    kernels = [("_gemv_kernel", 0.0, 5.0), ("_qk_norm_rope_kernel", 4.0, 7.0),  # PDL: starts before the gemv ends
               ("_decode_kernel", 8.0, 12.0), ("_gemv_kernel", 12.5, 15.0), ("nvjet_x", 15.0, 30.0)]
    t = pd.kind_table(kernels)
    assert t["kernels"] == 5 and t["span_us"] == 30.0
    assert t["kinds"]["lm_head"] == {"count": 1, "sum_us": 15.0, "busy_us": 15.0}  # the last product
    assert t["kinds"]["gemv"]["count"] == 2 and t["kinds"]["gemv"]["sum_us"] == pytest.approx(7.5)
    assert t["kinds"]["rotary"]["busy_us"] == pytest.approx(2.0)  # only 5..7: 4..5 belongs to the gemv
    assert t["busy_us"] == pytest.approx(5 + 2 + 4 + 2.5 + 15)
    assert t["top"][0][0] == "nvjet_x"


def test_summary_rows():
    bucket = {"replay_b2b_ms": 1.0, "kernels": 200}
    report = {"models": {"m": {"sets": {
        "all": {"buckets": {"1": bucket}, "edges": {"1": {"programmatic_edges": 190,
                                                          "pdl_kernels_without_programmatic_edge": 0}}},
        "none": {"buckets": {"1": {**bucket, "replay_b2b_ms": 1.5, "kernels": 260}}}}}}}
    (row,) = pd.summary_rows(report)
    assert row["replay_ms"] == {"all": 1.0, "none": 1.5} and row["kernels"] == {"all": 200, "none": 260}
    assert row["pdl_edges_ok"] is True
    pd.print_summary([row], ["all", "none"])
