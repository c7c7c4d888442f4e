"""Triton paged attention vs the plain-PyTorch oracle (kernels/reference.py).

Without CUDA the kernels run in the Triton interpreter on CPU (small shapes: it is slow). With CUDA the
same small cases compile for the GPU, and the `gpu` tests add realistic sizes and CUDA-graph capture.
"""
import os

import pytest
import torch

# The interpreter is chosen when a kernel is decorated, i.e. when kernels.attention is first imported, so
# this must come before that import. Only without CUDA: on a GPU machine it would make every later
# test module in the process run interpreted kernels too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from nanoserve.kernels import attention as tk  # noqa: E402
from nanoserve.kernels import reference as torch_ref  # noqa: E402
from nanoserve.kernels._triton import num_sms  # noqa: E402
from nanoserve.model.attention_metadata import AttentionMetadata  # noqa: E402
from nanoserve.kernels.switches import switched  # noqa: E402

if not torch.cuda.is_available() and type(tk._decode_kernel).__name__ != "InterpretedFunction":
    pytest.skip("kernels.attention was imported before TRITON_INTERPRET=1 was set; its kernels cannot run on CPU",
                allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "kernel output has NaN/inf"
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


class PagedBatch:
    """Sequences of given context lengths scattered over shuffled cache blocks.

    Slots outside every context (tails of last blocks, unused blocks, the dummy block that pads the
    block tables) hold NaN, so a kernel that lets them into its output shows up.
    """

    def __init__(self, context_lens, block_size, num_kv_heads, head_dim, dtype, spare_blocks=1, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        blocks_per_seq = [triton.cdiv(max(c, 1), block_size) for c in context_lens]
        self.max_blocks = max(blocks_per_seq) + spare_blocks
        num_blocks = sum(blocks_per_seq) + 2  # + one never used + the dummy (last) block
        self.dummy = num_blocks - 1
        perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
        tables = torch.full((len(context_lens), self.max_blocks), self.dummy, dtype=torch.int32)
        valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, (c, n) in enumerate(zip(context_lens, blocks_per_seq)):
            tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
            pos = torch.arange(c)
            valid[tables[i, pos // block_size].long() * block_size + pos % block_size] = True
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=gen).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
        invalid = ~valid.view(num_blocks, block_size, 1, 1)
        self.k_cache = k.masked_fill(invalid, float("nan")).to(DEVICE)
        self.v_cache = v.masked_fill(invalid, float("nan")).to(DEVICE)
        self.block_tables = tables.to(DEVICE)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)

    def slots(self, seq: int, positions: range) -> list[int]:
        table = self.block_tables[seq].tolist()
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]


def decode_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits=None, seed=0):
    batch = PagedBatch(context_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = tk.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                              num_splits=num_splits)
    ref = torch_ref.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    return out, ref


def prefill_case(cached_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Store the new tokens' k/v (as the model would), then return (q, k, v, batch, meta)."""
    context_lens = [c + n for c, n in zip(cached_lens, query_lens)]
    batch = PagedBatch(context_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = [s for i, (c, n) in enumerate(zip(cached_lens, query_lens)) for s in batch.slots(i, range(c, c + n))]
    cu_q = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        context_lens=batch.context_lens, block_tables=batch.block_tables,
        cu_seqlens_q=cu_q.to(DEVICE), max_seqlen_q=max(query_lens),
        has_cached_prefix=any(c > 0 for c in cached_lens),
        query_lens_host=list(query_lens), context_lens_host=context_lens)
    tk.store_kv(k, v, batch.k_cache, batch.v_cache, meta.slot_mapping)
    return q, k, v, batch, meta


# --------------------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.float16)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference(src_dtype, cache_dtype, slot_dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 11, 6, 3, 32, 8
    # k and v are views into a packed qkv projection, as in the model: token stride != heads * dim.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(src_dtype).to(DEVICE)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    k_cache = torch.randn(5, block_size, num_kv_heads, head_dim).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(5 * block_size)[:num_tokens].to(slot_dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, k_ref, v_ref, slots.long())
    tk.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_rejects_mismatched_shapes():
    k = torch.zeros(2, 4, 16, device=DEVICE)
    cache = torch.zeros(3, 8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="do not match cache heads"):
        tk.store_kv(k, k, cache, cache.clone(), torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping"):
        tk.store_kv(k[:, :2], k[:, :2], cache, cache.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE))


# --------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("group", [1, 2, 4, 8, 7])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_decode_gqa_groups(group, num_splits):
    # 1 token, exactly one block, just over, several blocks, just over one 64-token tile.
    out, ref = decode_case([1, 16, 17, 49, 65], num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=16,
                           dtype=torch.float32, num_splits=num_splits)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size,head_dim,dtype", [(8, 64, torch.float16), (32, 128, torch.bfloat16),
                                                       (16, 16, torch.float32), (16, 256, torch.bfloat16),
                                                       (16, 80, torch.float32)])
def test_decode_block_sizes_head_dims_dtypes(block_size, head_dim, dtype):
    lens = [1, block_size, block_size + 1, 3 * block_size, 130]
    out, ref = decode_case(lens, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                           dtype=dtype, num_splits=3)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_decode_every_context_length_with_splits(num_splits):
    """Each length from 1 to 200, its context spread over 2 or 4 splits in whole tiles: every boundary of
    blocks, tiles and partitions, and splits past the context (which must exit early)."""
    block_size, max_context = 8, 200
    out, ref = decode_case(list(range(1, max_context + 1)), num_heads=2, num_kv_heads=1, head_dim=16,
                           block_size=block_size, dtype=torch.float32, num_splits=num_splits)
    assert_close(out, ref, torch.float32)


def test_decode_empty_context_gives_zeros():
    """Padded CUDA-graph rows may have context_len 0; they must give finite output, not NaN."""
    batch = PagedBatch([5, 0, 70], block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    q = torch.randn(3, 4, 32, device=DEVICE)
    ref = torch_ref.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.2)
    for splits in (1, 2):
        out = tk.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.2,
                                  num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], rtol=2e-5, atol=2e-5)


def test_decode_strided_query():
    batch = PagedBatch([40, 3], block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    packed = torch.randn(2, 8, 32, device=DEVICE)
    q = packed[:, ::2]  # head stride 64, not 32
    out = tk.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.3)
    ref = torch_ref.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.3)
    assert_close(out, ref, torch.float32)


def test_decode_num_splits_from_static_shapes_only():
    sms = 132
    assert tk.decode_num_splits(1, 8, 512, sms) == 512 // tk.DECODE_MIN_PARTITION  # capped by the minimum partition
    assert tk.decode_num_splits(1, 8, 32768, sms) == min(triton.cdiv(tk.DECODE_WAVES_SPARSE * sms, 8),
                                                          tk.DECODE_MAX_SPLITS)  # a sparse grid: many splits
    assert tk.decode_num_splits(sms, 1, 32768, sms) == tk.DECODE_WAVES  # a full grid: a few waves
    assert tk.decode_num_splits(256, 8, 32768, sms) == 1  # the batch alone fills the GPU
    assert tk.decode_num_splits(1, 1, 10 ** 7, sms) == tk.DECODE_MAX_SPLITS
    assert tk.decode_num_splits(4, 8, 16, sms) == 1


def test_decode_rejects_bad_shapes():
    batch = PagedBatch([4], block_size=16, num_kv_heads=3, head_dim=32, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_heads a multiple"):
        tk.decode_attention(torch.zeros(1, 4, 32, device=DEVICE), batch.k_cache, batch.v_cache,
                            batch.block_tables, batch.context_lens, 1.0)


# --------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("group", [1, 2, 4, 8, 7])
def test_prefill_without_prefix(group):
    q, k, v, batch, meta = prefill_case([0, 0, 0, 0], [1, 16, 17, 40], num_heads=2 * group, num_kv_heads=2,
                                        head_dim=32, block_size=16, dtype=torch.float32)
    out = tk.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 0.25)
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 0.25)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size,head_dim,dtype,group", [(16, 64, torch.float32, 2), (8, 32, torch.bfloat16, 4),
                                                             (32, 64, torch.float16, 1), (16, 32, torch.float32, 3)])
def test_prefill_with_cached_prefix(block_size, head_dim, dtype, group):
    # Cached prefix lengths: none, one full block, mid-block, long; new tokens: 1 to more than a 64-row tile.
    cached, new = [0, block_size, 20, 70], [3, 1, 70, 9]
    q, k, v, batch, meta = prefill_case(cached, new, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                                        block_size=block_size, dtype=dtype, seed=3)
    out = tk.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, head_dim ** -0.5)
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, head_dim ** -0.5)
    assert_close(out, ref, dtype)


def test_prefill_work_list_lists_every_tile_once():
    seq, start = tk.prefill_work([1, 16, 17, 0, 40], 16)
    assert seq.tolist() == [0, 1, 2, 2, 4, 4, 4] and start.tolist() == [0, 0, 0, 16, 0, 16, 32]
    assert len(seq) <= tk.prefill_work_capacity(74, 5, 16)


def test_prefill_work_list_longest_first():
    """With context lengths the tiles are ordered by the keys they read, most first; still each tile once."""
    lens, ctx = [1, 16, 17, 40], [1, 116, 17, 40]  # the second sequence has a 100-token cached prefix
    seq, start = tk.prefill_work(lens, 16, ctx)
    keys = [ctx[s] - lens[s] + min(f + 16, lens[s]) for s, f in zip(seq.tolist(), start.tolist())]
    assert keys == sorted(keys, reverse=True) and keys[0] == 116
    plain = tk.prefill_work(lens, 16)
    assert sorted(zip(seq.tolist(), start.tolist())) == sorted(zip(*(a.tolist() for a in plain)))


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (128, 32)])
def test_prefill_other_tilings(block_m, block_n):
    """Tilings the tile benchmark tries (benchmarks/prefill_attention_tiles.py) give the oracle's output too,
    with tiles below the causal diagonal (unmasked) and on it."""
    cached, new = [0, 40, 3], [90, 30, 1]
    q, k, v, batch, meta = prefill_case(cached, new, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                        dtype=torch.float32, seed=4)
    tiles = tk.PrefillTiles(group=2, block_d=32, block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    out = tk.paged_prefill_attention(q, batch.k_cache, batch.v_cache, meta, 0.3, tiles)
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 0.3)
    assert_close(out, ref, torch.float32)


def test_prefill_fixed_work_list_and_table_rows_as_a_graph_sees_them():
    """The capturable form: a work list padded with -1 to its capacity, padded (empty) sequences, query rows past
    the last sequence, and block-table rows reached through table_rows — same output as the plain call."""
    cached, new = [0, 20, 5], [9, 1, 40]
    q, k, v, batch, meta = prefill_case(cached, new, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                        dtype=torch.float32, seed=5)
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 0.3)
    pad_tokens, pad_seqs = 14, 2
    qp = torch.cat([q, torch.randn(pad_tokens, 4, 32, device=DEVICE)])
    order = [2, 0, 1]  # sequence i's table is row order[i] of a permuted table
    tables = torch.empty_like(batch.block_tables)
    tables[order] = batch.block_tables
    q_per_tile = tk.prefill_q_per_tile(4, 2, 32, 4)
    seq, start = tk.prefill_work(new + [0] * pad_seqs, q_per_tile)
    capacity = tk.prefill_work_capacity(sum(new) + pad_tokens, len(new) + pad_seqs, q_per_tile)
    fill = lambda a: torch.tensor(list(a) + [-1] * (capacity - len(a)), dtype=torch.int32, device=DEVICE)  # noqa
    cu = torch.tensor([0] + new + [0] * pad_seqs, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    ctx = torch.tensor([c + n for c, n in zip(cached, new)] + [0] * pad_seqs, dtype=torch.int32, device=DEVICE)
    fixed = AttentionMetadata(is_prefill=True, slot_mapping=meta.slot_mapping, context_lens=ctx, block_tables=tables,
                              cu_seqlens_q=cu, has_cached_prefix=True, work_seq=fill(seq), work_start=fill(start),
                              table_rows=torch.tensor(order + [0] * pad_seqs, dtype=torch.int32, device=DEVICE))
    out = tk.paged_prefill_attention(qp, batch.k_cache, batch.v_cache, fixed, 0.3)
    assert_close(out[:sum(new)], ref, torch.float32)
    twin = torch_ref.prefill_attention(qp, None, None, batch.k_cache, batch.v_cache, fixed, 0.3)
    assert_close(twin[:sum(new)], ref, torch.float32)
    assert torch.all(twin[sum(new):] == 0)


@pytest.mark.usefixtures("pdl_in_interpreter")
def test_pdl_path_in_the_interpreter():
    test_store_kv_matches_reference(torch.float32, torch.float32, torch.int64)
    test_decode_gqa_groups(2, 2)
    test_decode_empty_context_gives_zeros()
    test_prefill_with_cached_prefix(16, 64, torch.float32, 2)


# --------------------------------------------------------------------------------------------- GPU, realistic sizes


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8), (32, 32)])
@pytest.mark.parametrize("max_context", [600, 5000])
def test_gpu_decode_realistic(num_heads, num_kv_heads, max_context):
    lens = torch.randint(1, max_context + 1, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    lens[:3] = [1, 16, max_context]
    out, ref = decode_case(lens, num_heads, num_kv_heads, 128, 16, torch.bfloat16)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_decode_dtypes(dtype):
    out, ref = decode_case([1, 300, 2049, 4000], 32, 8, 128, 16, dtype, num_splits=6)
    assert_close(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_decode_in_cuda_graph(pdl):
    """Capture store_kv + decode once, then replay after changing block tables and context lengths in place (with
    PDL, store_kv lets decode launch as its first statement: decode must still see the key it stores)."""
    num_seqs, num_heads, num_kv_heads, head_dim, block_size = 8, 32, 8, 128, 16
    batch = PagedBatch([1, 17, 3000, 5, 64, 65, 999, 1200], block_size, num_kv_heads, head_dim, torch.bfloat16)
    # Static buffers, captured while they describe one-token contexts in block 0.
    k_cache, v_cache = torch.zeros_like(batch.k_cache), torch.zeros_like(batch.v_cache)
    tables = torch.zeros_like(batch.block_tables)
    lens = torch.ones_like(batch.context_lens)
    slots = torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE)
    q = torch.randn(num_seqs, num_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    k_new = torch.randn(num_seqs, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_new = torch.randn_like(k_new)
    scale = head_dim ** -0.5
    max_context = tables.shape[1] * block_size
    assert tk.decode_num_splits(num_seqs, num_kv_heads, max_context, num_sms(DEVICE)) > 1  # reduce is captured

    def step():
        tk.store_kv(k_new, v_new, k_cache, v_cache, slots)
        return tk.decode_attention(q, k_cache, v_cache, tables, lens, scale)

    with switched(pdl=pdl):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    # New contents in place; each sequence's last token is this step's k/v.
    k_cache.copy_(batch.k_cache)
    v_cache.copy_(batch.v_cache)
    tables.copy_(batch.block_tables)
    lens.copy_(batch.context_lens)
    last = [batch.slots(i, range(c - 1, c))[0] for i, c in enumerate(batch.context_lens.tolist())]
    slots.copy_(torch.tensor(last, device=DEVICE))
    graph.replay()
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    torch_ref.store_kv(k_new, v_new, k_ref, v_ref, slots)
    ref = torch_ref.decode_attention(q, k_ref, v_ref, batch.block_tables, batch.context_lens, scale)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_prefill_realistic(cached, dtype):
    new = [1, 17, 300, 1500, 64, 777]
    prefix = [0, 16, 250, 500, 3, 1000] if cached else [0] * len(new)
    q, k, v, batch, meta = prefill_case(prefix, new, 32, 8, 128, 16, dtype, seed=11)
    out = tk.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 128 ** -0.5)
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 128 ** -0.5)
    assert_close(out, ref, dtype)
    if not cached:  # the paged kernel is the fallback everywhere varlen_attn does not fit
        paged = tk.paged_prefill_attention(q, batch.k_cache, batch.v_cache, meta, 128 ** -0.5)
        assert_close(paged, ref, dtype)


@pytest.mark.gpu
def test_gpu_store_kv_realistic():
    num_tokens, num_kv_heads, head_dim = 3000, 8, 128
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn_like(k)
    k_cache = torch.zeros(400, 16, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(400 * 16, device=DEVICE)[:num_tokens]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, k_ref, v_ref, slots)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
