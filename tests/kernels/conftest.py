"""Fixtures of the kernel tests."""
from pathlib import Path

import pytest
import torch

from nanoserve.kernels import _triton, attention, fused, gemv, moe, moe_gemm, rotary_kv

PDL_MODULES = (attention, fused, gemv, moe, moe_gemm, rotary_kv)

tl = _triton.tl  # the interpreter wants triton.language among a jit function's globals

if _triton.HAS_TRITON:

    @_triton.triton.jit
    def _no_gdc():
        pass


@pytest.fixture
def pdl_in_interpreter(monkeypatch):
    """The kernels' USE_PDL path, run in the CPU interpreter: it has no grid-dependency control, so gdc_wait and
    gdc_launch_dependents become no-ops there; what is tested is everything else that path does (the first
    weight tile loaded before the wait, the loop that starts one tile later)."""
    if torch.cuda.is_available() or not _triton.HAS_TRITON:
        pytest.skip("the USE_PDL path runs in the interpreter here; on a GPU the gpu tests run it for real")
    monkeypatch.setattr(_triton, "gdc_wait", _no_gdc)
    monkeypatch.setattr(_triton, "gdc_launch_dependents", _no_gdc)
    for module in PDL_MODULES:
        monkeypatch.setattr(module, "pdl_args", lambda device: {"USE_PDL": True})


def pytest_collection_modifyitems(config, items):
    """With CUDA every kernel test is a GPU test: the cases the CPU runs in the interpreter then compile for the
    GPU, so `pytest -m gpu tests/kernels` checks each kernel against its reference there too."""
    if not torch.cuda.is_available():
        return
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
