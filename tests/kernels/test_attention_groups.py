"""Decode rows read as groups (kernels/attention.decode_attention's seq_rows): a sequence verifying k drafts runs as
k + 1 consecutive rows (group_back: how many come before each) whose context lengths rise by one; one program per
(group, kv head, split) reads the keys once for all of them. Every row must still equal the oracle's per-row attention (kernels/reference.py).

Without CUDA the kernels run in the Triton interpreter on CPU (small shapes); with CUDA the `gpu` cases add real ones.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from nanoserve.kernels import attention as tk  # noqa: E402
from nanoserve.kernels import reference as torch_ref  # noqa: E402

if not torch.cuda.is_available() and type(tk._decode_kernel).__name__ != "InterpretedFunction":
    pytest.skip("kernels.attention was imported before TRITON_INTERPRET=1 was set; its kernels cannot run on CPU",
                allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
def grouped_batch(groups, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """groups: (rows, last context) per sequence, (0, 0) a padding row. Each sequence's rows have contexts
    last - rows + 1 .. last; a row's table names only the blocks its own context needs (the rest the
    NaN dummy block, as a verification row's columns that later rows bring are unspecified). Returns (q, k_cache,
    v_cache, tables, context_lens, group_back)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [last for _rows, last in groups if last]
    blocks = [triton.cdiv(c, block_size) for c in lens]
    num_blocks = sum(blocks) + 1
    dummy = num_blocks - 1
    width = max(blocks, default=1) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen) for _ in range(2))
    k_cache[dummy] = v_cache[dummy] = float("nan")
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables, ctx, back = [], [], []
    for rows, last in groups:
        own = perm[:triton.cdiv(last, block_size)]
        perm = perm[len(own):]
        for i, c in enumerate(range(last - rows + 1, last + 1) if last else [0]):
            need = triton.cdiv(c, block_size)
            tables.append(own[:need] + [dummy] * (width - need))
            ctx.append(c)
            back.append(i)
    q = torch.randn(len(ctx), num_heads, head_dim, generator=gen)
    as_device = lambda t, dt: torch.tensor(t, dtype=dt, device=DEVICE)  # noqa: E731
    return (q.to(dtype).to(DEVICE), k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE),
            as_device(tables, torch.int32), as_device(ctx, torch.int32), as_device(back, torch.int32))


def check(groups, seq_rows, *, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
          num_splits=None, window=None, softcap=None, tol=2e-5):
    q, kc, vc, tables, ctx, back = grouped_batch(groups, block_size, num_heads, num_kv_heads, head_dim, dtype)
    opts = {"window": window, "softcap": softcap}
    ref = torch_ref.decode_attention(q, kc, vc, tables, ctx, 0.3, **opts)
    out = tk.decode_attention(q, kc, vc, tables, ctx, 0.3, num_splits=num_splits, seq_rows=seq_rows, group_back=back,
                              **opts)
    assert torch.isfinite(out).all(), "a row read a key past its own context"
    real = ctx > 0  # (the oracle has no keys for a padding row; the kernel gives it zeros)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    torch.testing.assert_close(out[real].float(), ref[real].float(), rtol=tol, atol=tol)
    return out


# Groups of 1..5 rows, contexts from 1 token to several tiles, across block and tile boundaries, padding between.
GROUPS = [(5, 5), (1, 40), (3, 17), (0, 0), (5, 66), (2, 2), (4, 129), (0, 0), (0, 0)]


@pytest.mark.parametrize("num_kv_heads,num_heads", [(2, 2), (1, 3), (2, 8)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_groups_equal_per_row_attention(num_kv_heads, num_heads, num_splits):
    check(GROUPS, 5, num_heads=num_heads, num_kv_heads=num_kv_heads, num_splits=num_splits)


@pytest.mark.parametrize("window,softcap", [(4, None), (19, 5.0), (None, 3.0)])
def test_groups_with_window_and_softcap(window, softcap):
    check(GROUPS, 5, num_splits=2, window=window, softcap=softcap)


def test_groups_smaller_than_the_limit_and_plain_rows():
    """seq_rows 8 over groups of at most 5 (the kernel sizes its tile for 8); plain decode rows (groups of one)
    with seq_rows > 1 equal seq_rows 1 bit for bit."""
    check(GROUPS, 8, num_splits=2)
    plain = [(1, c) for c in (1, 9, 33, 70)] + [(0, 0)] * 3
    assert torch.equal(check(plain, 5, num_splits=3), check(plain, 1, num_splits=3))


@pytest.mark.parametrize("tile,num_heads", [(4, 4), (4, 6), (8, 4)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_groups_read_in_chunks(monkeypatch, tile, num_heads, num_splits):
    """A group of more query rows than DECODE_GROUP_TILE is read in chunks of rows from its last (2 rows of 2 heads
    a chunk; 1 row of 3; 4 rows of 2), each chunk's keys ending with its own last row's."""
    monkeypatch.setattr(tk, "DECODE_GROUP_TILE", tile)
    check(GROUPS, 5, num_heads=num_heads, num_kv_heads=2, num_splits=num_splits)
    check(GROUPS, 5, num_heads=num_heads, num_kv_heads=2, num_splits=num_splits, window=7)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_groups_half_precision(dtype, tol):
    check(GROUPS, 5, block_size=16, head_dim=64, dtype=dtype, num_splits=2, tol=tol)


def test_every_context_length_in_groups():
    """Groups of 3 ending at every context from 3 to 70, over 1 and 4 splits: every boundary of blocks, tiles and
    partitions falls inside some group."""
    groups = [(3, c) for c in range(3, 71)]
    for splits in (1, 4):
        check(groups, 3, num_heads=2, num_kv_heads=1, head_dim=16, num_splits=splits)


def test_groups_need_group_back():
    q, kc, vc, tables, ctx, _back = grouped_batch([(2, 5)], 8, 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match=r"seq_rows 4 needs group_back \[2\]"):
        tk.decode_attention(q, kc, vc, tables, ctx, 0.3, seq_rows=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 8, 128), (9, 3, 64)])
def test_gpu_groups_real_shapes(num_heads, num_kv_heads, head_dim):
    """Llama-3.1-8B, Qwen3-0.6B and SmolLM2 heads: 32 sequences verifying 4 drafts at 512-token contexts (and some
    shorter), bf16, with the splits the shape heuristic picks and with 4."""
    groups = [(5, 512 + i) for i in range(28)] + [(2, 37), (5, 1000), (1, 300), (3, 3)] + [(0, 0)] * 7
    for splits in (None, 4):
        check(groups, 5, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
              dtype=torch.bfloat16, num_splits=splits, tol=2e-2)
