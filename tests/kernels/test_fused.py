"""Fused Triton ops == their PyTorch references (CPU via TRITON_INTERPRET=1, set in conftest; CUDA when present)."""
import math

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


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("force_triton")
def test_silu_and_mul(dtype, activation):
    x = (torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)) * 4).to(DEVICE, dtype)
    torch.testing.assert_close(fused.silu_and_mul(x, activation=activation),
                               fused.silu_and_mul_ref(x, activation=activation), **tol(dtype))


def test_gelu_tanh_reference_is_hf_formula():
    """gelu_tanh is 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))) in fp32, as HF's gelu_pytorch_tanh; the
    reference computes act(gate) · up."""
    gate, up = torch.linspace(-12, 12, 101, dtype=torch.float64).float(), torch.linspace(-2, 3, 101).float()
    act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(fused.silu_and_mul_ref(torch.cat([gate, up])[None], "gelu_tanh")[0], act * up)


@pytest.mark.parametrize("quantize", [False, True])
def test_unknown_activation_is_refused(quantize):
    with pytest.raises(ValueError, match="gelu_erf"):
        fused.silu_and_mul(torch.zeros(2, 256), quantize=quantize, activation="gelu_erf")


@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_pdl_path_in_the_interpreter():
    test_rms_norm_with_and_without_residual(torch.float32, 100)
    test_silu_and_mul(torch.float32, "silu")
    test_silu_and_mul(torch.float32, "gelu_tanh")
