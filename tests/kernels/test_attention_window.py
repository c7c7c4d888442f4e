"""Sliding window and logit soft-cap in the Triton decode / paged prefill kernels vs the torch oracle (which
test_attention_window_reference.py checks against a dense masked softmax). CPU: the Triton interpreter, small shapes;
`gpu` tests: Gemma-3-4B- and Mistral-7B-like shapes.

Out-of-window tests poison what a windowed kernel must not read (the slots, and the block-table entries of blocks
that slid wholly out of every window, pointed at a NaN block): the output must stay finite and match the oracle
computed on the clean cache.
"""
import pytest
import torch

from nanoserve.model.attention_metadata import AttentionMetadata
from tests.kernels.test_attention import DEVICE, PagedBatch, assert_close, prefill_case, tk, torch_ref

WINDOWS = [1, 8, 13, 64, 1000]  # one key, a block, inside a block, a key tile, more than any context


def poison_before(batch: PagedBatch, seq: int, first_key: int) -> None:
    """Keys [0, first_key) of a sequence become NaN, and its table entries of blocks wholly before first_key point
    at the NaN dummy block."""
    if first_key <= 0:
        return
    slots = torch.tensor(batch.slots(seq, range(first_key)), device=DEVICE)
    for cache in (batch.k_cache, batch.v_cache):
        cache.view(-1, *cache.shape[2:])[slots] = float("nan")
    batch.block_tables[seq, :first_key // batch.block_size] = batch.dummy


def windowed_decode(context_lens, window, softcap, num_splits, num_heads=4, num_kv_heads=2, head_dim=16,
                    block_size=8, dtype=torch.float32, poison=True, seed=0):
    batch = PagedBatch(context_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q, scale = q.to(dtype).to(DEVICE), head_dim ** -0.5
    ref = torch_ref.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                                     window=window, softcap=softcap)
    if poison:
        for i, c in enumerate(context_lens):
            poison_before(batch, i, c - window)
    out = tk.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                              window=window, softcap=softcap, num_splits=num_splits)
    return out, ref


def windowed_prefill(cached, new, window, softcap, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                     dtype=torch.float32, tiles=None, poison=True, seed=0):
    q, k, v, batch, meta = prefill_case(cached, new, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    scale = head_dim ** -0.5
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, scale, window=window,
                                      softcap=softcap)
    if poison and window is not None:
        for i, c in enumerate(cached):
            poison_before(batch, i, c + 1 - window)  # before the first new token's window
    out = tk.paged_prefill_attention(q, batch.k_cache, batch.v_cache, meta, scale, tiles, window=window,
                                     softcap=softcap)
    return out, ref


# --------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_softcap(window, softcap, num_splits):
    # Contexts shorter than, at and past the window, ending at and just past block (8) and tile (64) edges.
    out, ref = windowed_decode([1, 7, 8, 9, 16, 17, 64, 65, 130], window, softcap, num_splits)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_decode_every_context_length_with_window(num_splits):
    """Each length 1..120 under a 20-key window (and blocks of 8, splits of whole 64-key tiles): the window's first
    key in every block offset, the partitions counted from it."""
    out, ref = windowed_decode(list(range(1, 121)), 20, None, num_splits, num_heads=2, num_kv_heads=1)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("group,block_size,head_dim,dtype", [(1, 16, 64, torch.float16), (8, 32, 128, torch.bfloat16),
                                                             (7, 16, 80, torch.float32)])
def test_decode_window_gqa_block_sizes_dtypes(group, block_size, head_dim, dtype):
    out, ref = windowed_decode([3, block_size, 2 * block_size + 5, 150], 2 * block_size + 3, 5.0, 3,
                               num_heads=2 * group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_close(out, ref, dtype)


def test_decode_window_empty_context_gives_zeros():
    batch = PagedBatch([5, 0, 70], block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    q = torch.randn(3, 4, 32, device=DEVICE)
    for splits in (1, 2):
        out = tk.decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.2,
                                  window=4, softcap=3.0, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("window", [None] + WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_prefill_window_softcap(window, softcap):
    # Cached prefixes: none, one block, across the window edge, longer than the window; new tokens: 1 to more
    # than a 64-row tile (group 2: 32 tokens a tile).
    out, ref = windowed_prefill([0, 16, 20, 70], [3, 1, 70, 9], window, softcap, seed=3)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size,head_dim,dtype,group,window", [(8, 32, torch.bfloat16, 4, 19),
                                                                    (32, 64, torch.float16, 1, 32),
                                                                    (16, 32, torch.float32, 3, 40)])
def test_prefill_window_block_sizes_dtypes_groups(block_size, head_dim, dtype, group, window):
    out, ref = windowed_prefill([0, block_size, 45, 100], [50, 1, 30, 40], window, 4.0, num_heads=2 * group,
                                head_dim=head_dim, block_size=block_size, dtype=dtype, seed=4)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("window", [5, 40, 70])
def test_prefill_window_small_tiles(window):
    """Tiles of 16 query tokens and 16 keys: a long chunk over a cached prefix has key tiles before every window
    (skipped), seen by some rows (masked), by every row (unmasked) and on the diagonal."""
    tiles = tk.PrefillTiles(group=2, block_d=32, block_m=32, block_n=16, num_warps=4, num_stages=2)
    out, ref = windowed_prefill([100, 0, 7], [90, 60, 1], window, None, tiles=tiles, seed=5)
    assert_close(out, ref, torch.float32)


def test_prefill_chunks_equal_whole_prompt_with_window():
    """Chunked prefill (the cached prefix crossing the window edge) gives the whole prompt's rows for its tokens."""
    window, prompt = 24, 80
    q, k, v, batch, meta = prefill_case([0], [prompt], 4, 2, 32, 16, torch.float32, seed=6)
    whole = tk.paged_prefill_attention(q, batch.k_cache, batch.v_cache, meta, 0.2, window=window, softcap=3.0)
    for cached in (17, 40, 79):  # each chunk poisons what it must not read, which later chunks do not read either
        n = prompt - cached
        chunk_meta = AttentionMetadata(is_prefill=True, slot_mapping=meta.slot_mapping[cached:],
                                       context_lens=meta.context_lens, block_tables=batch.block_tables,
                                       cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                       max_seqlen_q=n, has_cached_prefix=True, query_lens_host=[n],
                                       context_lens_host=[prompt])
        poison_before(batch, 0, cached + 1 - window)
        chunk = tk.paged_prefill_attention(q[cached:], batch.k_cache, batch.v_cache, chunk_meta, 0.2, window=window,
                                           softcap=3.0)
        assert_close(chunk, whole[cached:], torch.float32)


def test_prefill_attention_routes_window_and_softcap():
    """The dispatcher takes them to the paged kernel here (no flash varlen on CPU), with their meaning."""
    q, k, v, batch, meta = prefill_case([0, 0], [30, 7], 4, 2, 32, 16, torch.float32, seed=7)
    out = tk.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 0.2, window=6, softcap=1.5)
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, 0.2, window=6, softcap=1.5)
    assert_close(out, ref, torch.float32)


@pytest.mark.usefixtures("pdl_in_interpreter")
def test_window_pdl_path_in_the_interpreter():
    test_decode_window_softcap(13, 2.0, 3)
    test_prefill_window_softcap(13, 2.0)


# --------------------------------------------------------------------------------------------- GPU, real shapes

# (num_heads, num_kv_heads, head_dim, window, softcap, longest context): Gemma-3-4B-like (Gemma 2 adds the 50.0
# softcap), Mistral-7B-like.
REAL_SHAPES = [(8, 4, 256, 1024, None, 8192), (8, 4, 256, 1024, 50.0, 8192), (32, 8, 128, 4096, None, 10000)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window,softcap,longest", REAL_SHAPES)
def test_gpu_decode_window_real_shapes(num_heads, num_kv_heads, head_dim, window, softcap, longest):
    lens = torch.randint(1, longest + 1, (16,), generator=torch.Generator().manual_seed(8)).tolist()
    lens[:4] = [1, window, window + 1, longest]
    for splits in (None, 1):
        out, ref = windowed_decode(lens, window, softcap, splits, num_heads, num_kv_heads, head_dim, 16,
                                   torch.bfloat16)
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window,softcap,longest", REAL_SHAPES)
@pytest.mark.parametrize("cached", [False, True])
def test_gpu_prefill_window_real_shapes(num_heads, num_kv_heads, head_dim, window, softcap, longest, cached):
    new = [1, 300, window + 7, longest // 2]
    prefix = [0, window - 5, 2 * window, longest // 2] if cached else [0] * len(new)
    q, k, v, batch, meta = prefill_case(prefix, new, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, seed=9)
    scale = head_dim ** -0.5
    ref = torch_ref.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, scale, window=window,
                                      softcap=softcap)
    # Without a prefix and softcap this is flash varlen with its window; the paged kernel everywhere else.
    out = tk.prefill_attention(q, k, v, batch.k_cache, batch.v_cache, meta, scale, window=window, softcap=softcap)
    assert_close(out, ref, torch.bfloat16)
    paged, _ = windowed_prefill(prefix, new, window, softcap, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16,
                                seed=9)
    assert_close(paged, ref, torch.bfloat16)
