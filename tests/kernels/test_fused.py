"""Fused Triton ops == their PyTorch references (CPU via TRITON_INTERPRET=1, set in conftest; CUDA when present)."""
import pytest
import torch

from nanoserve.kernels import fused
from nanoserve.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 100, 1024])
@pytest.mark.usefixtures("force_triton")
def test_rms_norm_with_and_without_residual(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g).to(DEVICE, dtype)
    r = torch.randn(5, n, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, generator=g).to(DEVICE, dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6),
                               fused.rms_norm_ref(x, w, 1e-6), **tol(dtype))
    out, res = fused.rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_res = fused.rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    torch.testing.assert_close(res, ref_res, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("force_triton")
def test_silu_and_mul(dtype):
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    torch.testing.assert_close(fused.silu_and_mul(x), fused.silu_and_mul_ref(x), **tol(dtype))


@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_pdl_path_in_the_interpreter():
    test_rms_norm_with_and_without_residual(torch.float32, 100)
    test_silu_and_mul(torch.float32)
