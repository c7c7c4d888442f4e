"""benchmarks/fp8_dot_decode.py's experimental fp8 decode kernel (e4m3 products, keys as the products' M) against
its fp32 oracle in the interpreter: both V layouts, one split and several, a one-token context among longer ones."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import fp8_dot_decode  # noqa: E402


def test_fp8_dot_decode_matches_its_oracle():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the check runs the kernel in the CPU interpreter; on a GPU the benchmark measures it")
    errors = fp8_dot_decode.check_errors()
    engine = errors.pop("engine")
    assert len(errors) == 4 and 0 < engine < 0.05
    assert max(errors.values()) <= fp8_dot_decode.CHECK_TOLERANCE * engine, (engine, errors)
