"""torch_ref (the oracle of the Triton kernels) vs naive dense causal attention, written out per head in float64."""
import math

import pytest
import torch

from nanoserve.kernels import reference as torch_ref
from nanoserve.model.attention_metadata import AttentionMetadata


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.., k/v [ctx, Hkv, D] at 0..ctx-1; query head h reads kv head h // group."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = first_pos + i + 1
        for h in range(num_heads):
            keys, values = k[:visible, h // group].double(), v[:visible, h // group].double()
            scores = [float(q[i, h].double() @ keys[j]) * scale for j in range(visible)]
            top = max(scores)
            weights = torch.tensor([math.exp(s - top) for s in scores], dtype=torch.float64)
            out[i, h] = (weights[:, None] * values).sum(0) / weights.sum()
    return out


class Paged:
    """Contiguous per-sequence k/v for the naive side, the same tokens scattered over shuffled blocks."""

    def __init__(self, context_lens, block_size, num_kv_heads, head_dim, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        counts = [-(-c // block_size) for c in context_lens]
        num_blocks = sum(counts) + 1
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables = torch.full((len(context_lens), max(counts)), perm[-1], dtype=torch.int32)
        self.k = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in context_lens]
        self.v = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in context_lens]
        self.k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
        self.v_cache = self.k_cache.clone()
        for i, n in enumerate(counts):
            self.block_tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)

    def slots(self, seq: int, positions: range) -> torch.Tensor:
        table = self.block_tables[seq]
        return torch.tensor([int(table[p // self.block_size]) * self.block_size + p % self.block_size
                             for p in positions], dtype=torch.int64)

    def store(self, seq: int, positions: range) -> torch.Tensor:
        slots = self.slots(seq, positions)
        torch_ref.store_kv(self.k[seq][positions.start:positions.stop], self.v[seq][positions.start:positions.stop],
                           self.k_cache, self.v_cache, slots)
        return slots


def prefill_meta(paged: Paged, cached_lens: list[int]) -> AttentionMetadata:
    context_lens = paged.context_lens.tolist()
    query_lens = [c - p for c, p in zip(context_lens, cached_lens)]
    slots = torch.cat([paged.store(i, range(p, c)) for i, (p, c) in enumerate(zip(cached_lens, context_lens))])
    return AttentionMetadata(
        is_prefill=True, slot_mapping=slots, context_lens=paged.context_lens, block_tables=paged.block_tables,
        cu_seqlens_q=torch.tensor([0] + query_lens).cumsum(0).int(),
        max_seqlen_q=max(query_lens), has_cached_prefix=any(cached_lens),
        query_lens_host=query_lens, context_lens_host=context_lens)


def test_store_kv_then_gather_context_round_trips():
    paged = Paged([1, 8, 9, 30], block_size=8, num_kv_heads=2, head_dim=4)
    for i, c in enumerate(paged.context_lens.tolist()):
        paged.store(i, range(c))
    for i, c in enumerate(paged.context_lens.tolist()):
        assert torch.equal(torch_ref.gather_context(paged.k_cache, paged.block_tables[i], c), paged.k[i])
        assert torch.equal(torch_ref.gather_context(paged.v_cache, paged.block_tables[i], c), paged.v[i])


def test_store_kv_casts_to_cache_dtype():
    cache = torch.zeros(2, 4, 1, 3, dtype=torch.bfloat16)
    k = torch.randn(2, 1, 3)
    torch_ref.store_kv(k, k, cache, cache.clone(), torch.tensor([5, 0]))
    assert torch.equal(cache.view(-1, 1, 3)[[5, 0]], k.to(torch.bfloat16))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_prefill_matches_naive_causal_attention(num_heads, num_kv_heads, with_prefix):
    context_lens = [1, 8, 13, 21]
    cached = [0, 8, 5, 20] if with_prefix else [0, 0, 0, 0]
    paged = Paged(context_lens, block_size=8, num_kv_heads=num_kv_heads, head_dim=16, seed=1)
    for i, p in enumerate(cached):  # the prefix is in the cache from an earlier step
        paged.store(i, range(p))
    meta = prefill_meta(paged, cached)
    q_parts = [torch.randn(c - p, num_heads, 16) for c, p in zip(context_lens, cached)]
    q = torch.cat(q_parts)
    k_new = torch.cat([paged.k[i][p:] for i, p in enumerate(cached)])
    v_new = torch.cat([paged.v[i][p:] for i, p in enumerate(cached)])
    out = torch_ref.prefill_attention(q, k_new, v_new, paged.k_cache, paged.v_cache, meta, 0.3)
    expected = torch.cat([naive_attention(qi, paged.k[i], paged.v[i], cached[i], 0.3) for i, qi in enumerate(q_parts)])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_decode_matches_naive_attention_of_last_position(num_heads, num_kv_heads):
    context_lens = [1, 7, 8, 9, 40]
    paged = Paged(context_lens, block_size=8, num_kv_heads=num_kv_heads, head_dim=16, seed=2)
    for i, c in enumerate(context_lens):
        paged.store(i, range(c))
    # Never-written slots (block tails, the padding block) stay NaN: decode must keep them out.
    q = torch.randn(len(context_lens), num_heads, 16)
    out = torch_ref.decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.25)
    for i, c in enumerate(context_lens):
        expected = naive_attention(q[i:i + 1], paged.k[i], paged.v[i], c - 1, 0.25)[0]
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("junk_value", [1e4, float("nan")])
def test_decode_ignores_slots_beyond_context(junk_value):
    paged = Paged([5, 12], block_size=8, num_kv_heads=1, head_dim=8, seed=3)
    for i, c in enumerate([5, 12]):
        paged.store(i, range(c))
    k_cache, v_cache = torch.nan_to_num(paged.k_cache), torch.nan_to_num(paged.v_cache)
    q = torch.randn(2, 2, 8)
    before = torch_ref.decode_attention(q, k_cache, v_cache, paged.block_tables, paged.context_lens, 0.5)
    # Overwrite every slot that is not part of a context with junk.
    valid = torch.zeros(k_cache.shape[0] * 8, dtype=torch.bool)
    for i, c in enumerate([5, 12]):
        valid[paged.slots(i, range(c))] = True
    junk = ~valid.view(-1, 8, 1, 1)
    after = torch_ref.decode_attention(q, k_cache.masked_fill(junk, junk_value), v_cache.masked_fill(junk, junk_value),
                                       paged.block_tables, paged.context_lens, 0.5)
    torch.testing.assert_close(after, before)
