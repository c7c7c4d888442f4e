"""Fused Triton ops == their PyTorch references (CPU via TRITON_INTERPRET=1, set in conftest; CUDA when present)."""
import pytest
import torch

from nanoserve.model import fused_ops

pytestmark = pytest.mark.skipif(fused_ops.triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 100, 1024])
def test_rms_norm_with_and_without_residual(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g).to(DEVICE, dtype)
    r = torch.randn(5, n, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, generator=g).to(DEVICE, dtype)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6, force_triton=True),
                               fused_ops.rms_norm_ref(x, w, 1e-6), **tol(dtype))
    out, res = fused_ops.rms_norm(x, w, 1e-6, residual=r, force_triton=True)
    ref_out, ref_res = fused_ops.rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    torch.testing.assert_close(res, ref_res, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    torch.testing.assert_close(fused_ops.silu_and_mul(x, force_triton=True), fused_ops.silu_and_mul_ref(x), **tol(dtype))


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_on_strided_views(with_norm, dtype):
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, d = 4, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    angles = torch.rand(64, d // 2, generator=g) * 6
    cache = torch.cat([angles.cos(), angles.cos(), -angles.sin(), angles.sin()], dim=-1).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 63, 17], device=DEVICE)
    qw = torch.randn(d, generator=g).to(DEVICE, dtype) if with_norm else None
    kw = torch.randn(d, generator=g).to(DEVICE, dtype) if with_norm else None
    got = fused_ops.qk_norm_rope(q, k, cache, positions, qw, kw, 1e-6, force_triton=True)
    want = fused_ops.qk_norm_rope_ref(q, k, cache, positions, qw, kw, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(dtype))
