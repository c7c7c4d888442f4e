"""Sliding window and logit soft-cap in the torch oracle (kernels/reference.py) vs a dense masked softmax written out
here in float64, and the window rule vs transformers' own mask function."""
import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from nanoserve.kernels import reference as torch_ref
from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.model.layers import Attention


def dense_attention(q, k, v, first_pos, scale, window=None, softcap=None):
    """q [n, H, D] at positions first_pos.., k/v [ctx, Hkv, D] at 0..ctx-1 → [n, H, D] float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window is not None else True)
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hnk,khd->nhd", probs, v)


class Contexts:
    """Per-sequence contiguous k/v, and the same tokens scattered over shuffled cache blocks (other slots NaN)."""

    def __init__(self, context_lens, block_size, num_kv_heads, head_dim, seed=0):
        gen = torch.Generator().manual_seed(seed)
        counts = [-(-c // block_size) for c in context_lens]
        perm = torch.randperm(sum(counts) + 1, generator=gen)
        self.block_tables = torch.full((len(context_lens), max(counts)), int(perm[-1]), dtype=torch.int32)
        self.k_cache = torch.full((len(perm), block_size, num_kv_heads, head_dim), float("nan"))
        self.v_cache = self.k_cache.clone()
        self.k, self.v, used = [], [], 0
        for i, c in enumerate(context_lens):
            self.block_tables[i, :counts[i]] = perm[used:used + counts[i]]
            used += counts[i]
            self.k.append(torch.randn(c, num_kv_heads, head_dim, generator=gen))
            self.v.append(torch.randn(c, num_kv_heads, head_dim, generator=gen))
            pos = torch.arange(c)
            slots = self.block_tables[i, pos // block_size].long() * block_size + pos % block_size
            torch_ref.store_kv(self.k[i], self.v[i], self.k_cache, self.v_cache, slots)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)


WINDOWS = [None, 1, 5, 8, 13, 1000]


def test_window_rule_is_transformers_sliding_window_mask():
    for window in (1, 3, 8):
        expected = sliding_window_causal_mask_function(window)
        q_pos, k_pos = torch.arange(20), torch.arange(20)
        ours = torch_ref.visible_keys(q_pos, k_pos, window)
        zero = torch.tensor(0)
        theirs = torch.tensor([[bool(expected(zero, zero, torch.tensor(i), torch.tensor(j))) for j in range(20)]
                               for i in range(20)])
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_prefill_window_softcap_matches_dense(window, softcap):
    # Cached prefixes: none, a whole block, across the window edge, longer than the window; GQA 6 / 2.
    cached, context_lens = [0, 8, 6, 20], [1, 13, 21, 29]
    ctx = Contexts(context_lens, block_size=8, num_kv_heads=2, head_dim=16, seed=1)
    query_lens = [c - p for c, p in zip(context_lens, cached)]
    q_parts = [torch.randn(n, 6, 16, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(query_lens)]
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
                             context_lens=ctx.context_lens, block_tables=ctx.block_tables,
                             cu_seqlens_q=torch.tensor([0] + query_lens).cumsum(0).int(), max_seqlen_q=max(query_lens),
                             has_cached_prefix=True, query_lens_host=query_lens, context_lens_host=context_lens)
    out = torch_ref.prefill_attention(torch.cat(q_parts), None, None, ctx.k_cache, ctx.v_cache, meta, 0.4,
                                      window=window, softcap=softcap)
    expected = torch.cat([dense_attention(qi, ctx.k[i], ctx.v[i], cached[i], 0.4, window, softcap)
                          for i, qi in enumerate(q_parts)])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_decode_window_softcap_matches_dense(window, softcap):
    context_lens = [1, 5, 8, 9, 14, 40]
    ctx = Contexts(context_lens, block_size=8, num_kv_heads=2, head_dim=16, seed=2)
    q = torch.randn(len(context_lens), 4, 16)
    out = torch_ref.decode_attention(q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.context_lens, 0.3,
                                     window=window, softcap=softcap)
    for i, c in enumerate(context_lens):
        expected = dense_attention(q[i:i + 1], ctx.k[i], ctx.v[i], c - 1, 0.3, window, softcap)[0]
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-5, atol=1e-5)


def test_softcap_bounds_the_logits():
    scores = torch.tensor([-1e4, -3.0, 0.0, 2.0, 1e4])
    capped = torch_ref.soft_cap(scores, 5.0)
    assert capped.abs().max() <= 5.0 and torch.equal(torch_ref.soft_cap(scores, None), scores)
    torch.testing.assert_close(capped[2:4], torch.tensor([0.0, 5.0 * torch.tanh(torch.tensor(0.4))]))


@pytest.mark.parametrize("kwargs,match", [({"sliding_window": 0}, "sliding window"),
                                          ({"sliding_window": 4.0}, "sliding window"),
                                          ({"logit_softcap": 0.0}, "softcap")])
def test_attention_rejects_bad_window_or_softcap(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(4, 2, 16, 0.25, **kwargs)


def test_attention_layer_passes_its_window_and_softcap():
    ctx = Contexts([30], block_size=8, num_kv_heads=2, head_dim=16, seed=3)
    layer = Attention(4, 2, 16, 0.25, sliding_window=7, logit_softcap=2.0)
    layer.k_cache, layer.v_cache = ctx.k_cache, ctx.v_cache
    q = torch.randn(1, 4, 16)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(1, dtype=torch.int64),
                             context_lens=ctx.context_lens, block_tables=ctx.block_tables)
    out = layer(q, None, None, meta, kv_stored=True)
    expected = dense_attention(q, ctx.k[0], ctx.v[0], 29, 0.25, window=7, softcap=2.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert "sliding_window=7" in repr(layer) and "logit_softcap=2.0" in repr(layer)
