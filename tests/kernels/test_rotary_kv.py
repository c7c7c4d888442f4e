"""q/k RMSNorm + RoPE (+ KV-cache store) kernel == its PyTorch reference (CPU: TRITON_INTERPRET=1, see conftest)."""
import pytest
import torch

from nanoserve.kernels import rotary_kv
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.switches import switched

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def table(positions, rotary_dim, g, dtype):
    """A random cos/sin table [positions, 2 * rotary_dim] in the [cos, cos, -sin, sin] layout."""
    angles = torch.rand(positions, rotary_dim // 2, generator=g) * 6
    return torch.cat([angles.cos(), angles.cos(), -angles.sin(), angles.sin()], dim=-1).to(DEVICE, dtype)


@pytest.mark.parametrize("rotary_dim", [32, 24], ids=["full", "partial"])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("force_triton")
def test_qk_norm_rope_on_strided_views(with_norm, dtype, rotary_dim):
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, d = 4, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    cache = table(64, rotary_dim, g, dtype)
    positions = torch.tensor([0, 5, 63, 17], device=DEVICE)
    qw = torch.randn(d, generator=g).to(DEVICE, dtype) if with_norm else None
    kw = torch.randn(d, generator=g).to(DEVICE, dtype) if with_norm else None
    got = rotary_kv.qk_norm_rope(q, k, cache, positions, qw, kw, 1e-6)
    want = rotary_kv.qk_norm_rope_ref(q, k, cache, positions, qw, kw, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(dtype))
    if rotary_dim < d and not with_norm:  # the dims past rotary_dim pass through, bit for bit
        assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:])
        assert torch.equal(got[1][..., rotary_dim:], k[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_stores_k_and_v_in_the_paged_cache(dtype):
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, d, blocks, block_size = 3, 4, 2, 32, 5, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)
    angles = torch.rand(16, d // 2, generator=g) * 6
    cache = torch.cat([angles.cos(), angles.cos(), -angles.sin(), angles.sin()], dim=-1).to(DEVICE, dtype)
    positions = torch.tensor([3, 0, 9], device=DEVICE)
    slots = torch.tensor([17, 2, 9], device=DEVICE)
    caches = []
    for force in (True, False):
        k_cache = torch.zeros(blocks, block_size, kv_heads, d, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        with switched(force_triton=force):
            q_out, k_out = rotary_kv.qk_norm_rope(q, k, cache, positions, kv_store=(v, k_cache, v_cache, slots, None))
        caches.append((q_out, k_out, k_cache, v_cache))
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, **tol(dtype))
    k_cache, v_cache = caches[0][2].view(-1, kv_heads, d), caches[0][3].view(-1, kv_heads, d)
    torch.testing.assert_close(k_cache[slots], caches[0][1], **tol(dtype))
    torch.testing.assert_close(v_cache[slots], v, **tol(dtype))
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not k_cache[untouched.to(DEVICE)].any() and not v_cache[untouched.to(DEVICE)].any()


@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_pdl_path_in_the_interpreter():
    test_qk_norm_rope_on_strided_views(True, torch.float32, 24)
    test_qk_norm_rope_stores_k_and_v_in_the_paged_cache(torch.float32)


@pytest.mark.parametrize("rotary_dim", [32, 24], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("force_triton")
def test_token_blocked_kernel_matches_reference(dtype, rotary_dim, monkeypatch):
    """Prefill sizes take several tokens per program (the last block partial); same values and cache."""
    monkeypatch.setattr(rotary_kv, "ROPE_BLOCK_T", 4)
    monkeypatch.setattr(rotary_kv, "ROPE_MIN_TOKENS_PER_BLOCK", 4)
    g = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, d = 7, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)
    cache = table(32, rotary_dim, g, dtype)
    positions = torch.tensor([3, 0, 9, 31, 4, 4, 12], device=DEVICE)
    slots = torch.tensor([17, 2, 9, 0, 5, 6, 19], device=DEVICE)
    qw, kw = (torch.randn(d, generator=g).to(DEVICE, dtype) for _ in range(2))
    results = []
    for fn in (rotary_kv.qk_norm_rope, rotary_kv.qk_norm_rope_ref):
        k_cache = torch.zeros(5, 4, kv_heads, d, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        out = fn(q, k, cache, positions, qw, kw, 1e-6, kv_store=(v, k_cache, v_cache, slots, None))
        results.append((*out, k_cache, v_cache))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tol(dtype))


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_partial_rotary_matches_transformers_phi3(path):
    """Phi-4-mini's shape: head_dim 128, partial_rotary_factor 0.75 (96 rotated dims). Our table
    (RotaryEmbedding from rope_parameters) and kernels == transformers' Phi3RotaryEmbedding + apply_rotary_pos_emb."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from nanoserve.model.layers import RotaryEmbedding
    from nanoserve.rope_config import rope_parameters

    heads, kv_heads, d, tokens = 4, 2, 128, 6
    config = Phi3Config(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        max_position_embeddings=256, partial_rotary_factor=0.75)
    params = rope_parameters(config)
    rotary_dim = int(d * params["partial_rotary_factor"])
    assert rotary_dim == 96
    table = RotaryEmbedding(d, 256, params, torch.float32, rotary_dim).cos_sin_cache
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(tokens, heads, d, generator=g), torch.randn(tokens, kv_heads, d, generator=g)
    positions = torch.tensor([0, 1, 7, 100, 200, 255])
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    want = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    with switched(force_triton=path == "triton"):
        got = rotary_kv.qk_norm_rope(q.to(DEVICE), k.to(DEVICE), table.to(DEVICE), positions.to(DEVICE))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_table_wider_than_the_head_is_refused():
    with pytest.raises(ValueError, match="head_dim 16"):
        rotary_kv.qk_norm_rope_ref(torch.zeros(1, 2, 16), torch.zeros(1, 1, 16), torch.zeros(4, 40),
                                   torch.zeros(1, dtype=torch.long))

