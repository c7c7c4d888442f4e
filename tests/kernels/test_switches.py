"""The kernel switches: read once from the environment, flipped in-process by benchmarks and tests."""
import pytest
import torch

from nanoserve.kernels import _triton
from nanoserve.kernels.switches import SWITCHES, Switches, switched


def test_from_env():
    assert Switches.from_env({}) == Switches()  # every fusion on by default, force_triton off
    s = Switches.from_env({"NANOSERVE_PDL": "0", "NANOSERVE_FUSE_NORM": "1"})
    assert (s.pdl, s.fuse_norm, s.gemv_prefetch) == (False, True, True)
    assert not Switches.from_env({"NANOSERVE_GEMV_PREFETCH": "0"}).gemv_prefetch
    assert Switches.from_env({"NANOSERVE_FUSE_NORM_MAX_K": "4096"}).fuse_norm_max_k == 4096
    assert Switches.from_env({"NANOSERVE_FUSE_NORM_MIN_K": "0"}).fuse_norm_min_k == 0
    assert Switches.from_env({"NANOSERVE_FORCE_TRITON": "1"}).force_triton and not Switches().force_triton
    with pytest.raises(ValueError, match="NANOSERVE_PDL must be 0 or 1"):
        Switches.from_env({"NANOSERVE_PDL": "off"})


def test_switched_restores_and_rejects_unknown_names():
    before = dict(SWITCHES.__dict__)
    with switched(pdl=False, fuse_norm=False) as s:
        assert s is SWITCHES and not SWITCHES.pdl and not SWITCHES.fuse_norm
    assert SWITCHES.__dict__ == before
    with pytest.raises(ValueError, match="unknown switches"):
        with switched(pdl_everywhere=True):
            pass


def test_pdl_only_on_cuda_when_switched_on():
    assert _triton.pdl_args(torch.device("cpu")) == {"USE_PDL": False}
    with switched(pdl=False):
        assert not _triton.pdl_enabled(torch.device("cuda"))


def test_use_triton_on_cuda_with_triton_or_under_the_switch():
    cpu = torch.device("cpu")
    assert not _triton.use_triton(cpu) and not _triton.use_triton(torch.zeros(1))
    assert _triton.use_triton(torch.device("cuda")) == _triton.HAS_TRITON
    with switched(force_triton=True):
        assert _triton.use_triton(cpu) and _triton.use_triton(torch.zeros(1))


def test_force_triton_fixture_switches_for_one_test(force_triton):
    assert SWITCHES.force_triton and _triton.use_triton(torch.device("cpu"))
