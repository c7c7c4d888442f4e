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
    test_rms_norm_with_an_owed_post_norm_equals_two_calls(torch.float32, True, False)
    test_silu_and_mul(torch.float32, "silu")
    test_silu_and_mul(torch.float32, "gelu_tanh")


def _post_norm_case(dtype, n, seed=0):
    """x (a sub-layer's output, large values as Gemma's are), residual, the pre-norm and the owed post-norm weights."""
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(2, 5, n, generator=g) * torch.tensor([30.0, 1.0])[:, None, None]).to(DEVICE, dtype)
    w, w_post = (torch.randn(2, n, generator=g) + 1).to(DEVICE, dtype)
    return x, r, w, (w_post, 1e-5)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("force_triton")
def test_rms_norm_with_an_owed_post_norm_equals_two_calls(dtype, with_residual, quantize):
    """x_norm folds the post-norm into the kernel: bit for bit the two launches it replaces (the post-norm's output
    rounded to the model dtype), and close to the reference's two plain steps. Except fp32 on the GPU: the fold runs
    without FP fusion (so the post-norm's product is not fused with the residual add) and the two launches with it, so
    their fp32 sums of squares differ in the last bits; bf16's rounding hides that (measured on the H200)."""
    x, r, w, x_norm = _post_norm_case(dtype, 1000)
    residual = r if with_residual else None
    got = fused.rms_norm(x, w, 1e-6, residual, quantize=quantize, x_norm=x_norm)
    want = fused.rms_norm(fused.rms_norm(x, *x_norm), w, 1e-6, residual, quantize=quantize)
    got_out, want_out = (got[0], want[0]) if with_residual else (got, want)
    if x.is_cuda and dtype == torch.float32:
        if with_residual:
            torch.testing.assert_close(got[1], want[1], **tol(dtype))
        if quantize:  # an fp32 last bit may move a code one e4m3 step (at most 1/8 of it)
            torch.testing.assert_close(got_out.scales, want_out.scales, **tol(dtype))
            torch.testing.assert_close(got_out.codes.float(), want_out.codes.float(), rtol=0.125, atol=2 ** -9)
        else:
            torch.testing.assert_close(got_out, want_out, **tol(dtype))
        return
    if with_residual:
        assert torch.equal(got[1], want[1])
    if quantize:
        assert torch.equal(got_out.scales, want_out.scales)
        assert torch.equal(got_out.codes.float(), want_out.codes.float())
        return
    assert torch.equal(got_out, want_out)
    ref = fused.rms_norm_ref(x, w, 1e-6, residual, x_norm=x_norm)
    # bf16: an ulp the kernel's fp32 sum rounds differently in the post-norm's output can grow to a few after the add
    torch.testing.assert_close(got, ref, **(tol(dtype) if dtype == torch.float32 else dict(rtol=2e-2, atol=8e-2)))


def test_rms_norm_ref_with_an_owed_post_norm_is_two_plain_steps():
    x, r, w, (w_post, eps_post) = _post_norm_case(torch.float32, 64)
    h = w_post * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps_post))
    out, res = fused.rms_norm_ref(x, w, 1e-6, r, x_norm=(w_post, eps_post))
    torch.testing.assert_close(res, h + r)
    torch.testing.assert_close(out, w * (res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + 1e-6)))
