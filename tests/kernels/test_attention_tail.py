"""The fp8 cache's tail (kernels/kv_quant.py: each sequence's newest two blocks in the model's dtype) in the Triton
kernels vs the PyTorch oracle (kernels/reference.py): the store writes the oracle's tail rows, decode and paged prefill
read each query's own block exact as the oracle does, and everything else from the fp8 cache.

Slots nothing should read hold NaN: fp8 codes and scales outside every context, tail rows outside each sequence's
last two blocks, and (decode) the fp8 copy of the query's own block, which only the tail may give.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from nanoserve.kernels import attention as tk  # noqa: E402
from nanoserve.kernels import kv_quant  # noqa: E402
from nanoserve.kernels import reference as torch_ref  # noqa: E402
from nanoserve.model.attention_metadata import AttentionMetadata  # noqa: E402
from nanoserve.runner.kv_cache import fp8_layout  # noqa: E402
from test_attention import DEVICE, assert_close  # noqa: E402

if not torch.cuda.is_available() and type(tk._decode_kernel).__name__ != "InterpretedFunction":
    pytest.skip("kernels.attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

FP8 = kv_quant.FP8_DTYPE
NAN_CODE = 0x7F  # e4m3fn NaN


class TailState:
    """Sequences (slot slots[i], context_lens[i] tokens) in an fp8 cache, and the tail holding, of the tokens before
    tail_ends[i], those of the last two blocks (as the tail is when a step starts: decode's step token included)."""

    def __init__(self, context_lens, slots, block_size, num_kv_heads, head_dim, dtype, design, tail_ends=None,
                 spare_blocks=1, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.slots = block_size, list(slots)
        blocks = [triton.cdiv(max(c, 1), block_size) for c in context_lens]
        num_blocks = sum(blocks) + 2  # + one never used + the dummy (last) block
        num_slots = max(slots) + 1
        perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
        self.tables = torch.full((num_slots, max(blocks) + spare_blocks), num_blocks - 1, dtype=torch.int32)
        for s, n in zip(slots, blocks):  # one block-table row per slot, as the prefill's table_rows index them
            self.tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.caches = [torch.full(shape, NAN_CODE, dtype=torch.uint8).view(FP8) for _ in range(2)]
        if design == "token":
            self.scales = tuple(torch.full(shape[:3], torch.nan, dtype=kv_quant.TOKEN_SCALE_DTYPE) for _ in range(2))
        else:
            self.scales = (torch.tensor([0.03]), torch.tensor([0.025]))
        v_cache, self.scales = fp8_layout(self.caches[1], self.scales)  # the engine's layout
        self.caches = [self.caches[0], v_cache]
        rows = num_slots * kv_quant.TAIL_BANKS * block_size
        self.tail = tuple(torch.full((rows, num_kv_heads, head_dim), torch.nan, dtype=dtype) for _ in range(2))
        self.k, self.v, cache_slots, tail_rows = [], [], [], []
        for c, s, end in zip(context_lens, slots, tail_ends or context_lens):
            shape = (c, num_kv_heads, head_dim)
            size = torch.exp2(torch.randint(-2, 2, (c, num_kv_heads, 1), generator=gen).float())  # varied scales
            self.k.append((torch.randn(shape, generator=gen) * size).to(dtype))
            self.v.append((torch.randn(shape, generator=gen) * size).to(dtype))
            pos = torch.arange(c)
            cache_slots.append(self.slot_of(s, pos))
            recent = (pos < end) & (pos // block_size >= (end - 1) // block_size - 1)
            tail_rows.append(torch.where(recent, kv_quant.tail_row(s, pos, block_size), -1))
        self.cache_slots = torch.cat(cache_slots)
        torch_ref.store_kv(torch.cat(self.k), torch.cat(self.v), *self.caches, self.cache_slots, self.scales,
                           kv_tail=self.tail, tail_rows=torch.cat(tail_rows))
        self.caches = [c.to(DEVICE) for c in self.caches]
        self.scales = tuple(s.to(DEVICE) for s in self.scales)
        self.tail = tuple(t.to(DEVICE) for t in self.tail)
        self.tables = self.tables.to(DEVICE)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)

    def slot_of(self, slot: int, pos: torch.Tensor) -> torch.Tensor:
        pos = pos.to(self.tables.device)  # (the tables move to the kernels' device once the cache is built)
        return self.tables[slot, pos // self.block_size].long() * self.block_size + pos % self.block_size

    def poison_cache(self, slot: int, positions: torch.Tensor) -> None:
        """The fp8 copies (codes and per-token scales) of these positions become NaN."""
        at = self.slot_of(slot, positions.cpu()).to(DEVICE)
        blocks, offsets = at // self.block_size, at % self.block_size
        for cache, scale in zip(self.caches, self.scales):
            cache.view(torch.uint8)[blocks, offsets] = NAN_CODE
            if kv_quant.per_token(scale):
                scale[blocks, offsets] = torch.nan


# --------------------------------------------------------------------------------------------- store


@pytest.mark.parametrize("design", ["token", "layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_writes_the_oracles_tail(design, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, block_size, blocks = 10, 4, 2, 32, 4, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)  # strided views, as the model's
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    tail_rows = torch.randperm(3 * kv_quant.TAIL_BANKS * block_size, generator=gen)[:tokens].to(torch.int32)
    tail_rows[::3] = -1
    tail_rows = tail_rows.to(DEVICE)
    garbage = torch.randn(3 * kv_quant.TAIL_BANKS * block_size, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    out, ref = [], []
    for store, result in ((tk.store_kv, out), (torch_ref.store_kv, ref)):
        caches = [torch.zeros(blocks, block_size, kv_heads, dim, dtype=FP8, device=DEVICE) for _ in range(2)]
        if design == "token":
            scales = tuple(torch.zeros(blocks, block_size, kv_heads, device=DEVICE,
                                       dtype=kv_quant.TOKEN_SCALE_DTYPE) for _ in range(2))
        else:
            scales = (torch.tensor([0.03], device=DEVICE), torch.tensor([0.025], device=DEVICE))
        tail = (garbage.clone(), garbage.clone())
        store(k, v, *caches, slots, scales, kv_tail=tail, tail_rows=tail_rows)
        result.extend([c.view(torch.uint8) for c in caches] + list(scales) + list(tail))
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    assert not torch.equal(out[-2], garbage)  # the tail was written


# --------------------------------------------------------------------------------------------- decode


def decode_with_tail(lens, block_size, design, dtype, num_splits, window=None, softcap=None, heads=(4, 2), dim=16,
                     spare_blocks=1, seed=0, change_tail=False):
    """(kernel, oracle) for one decode step of sequences in scattered slots; the fp8 copy of each query's own block
    is poisoned before the kernel runs (it must read those keys from the tail)."""
    slots = [3 * i + 2 for i in range(len(lens))][::-1]
    st = TailState(lens, slots, block_size, heads[1], dim, dtype, design, spare_blocks=spare_blocks, seed=seed)
    if change_tail:  # the tail no longer equals the cache's tokens: the output must follow the tail
        for t in st.tail:
            t.add_(1.0)
    q = torch.randn(len(lens), heads[0], dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    slots_t = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    args = (q, *st.caches, st.tables[slots_t.long()], st.context_lens, dim ** -0.5)
    opts = dict(window=window, softcap=softcap, kv_scales=st.scales, kv_tail=st.tail, slots=slots_t)
    ref = torch_ref.decode_attention(*args, **opts)
    for c, s in zip(lens, slots):
        st.poison_cache(s, torch.arange(max(c - 1, 0) // block_size * block_size, c))
    return tk.decode_attention(*args, num_splits=num_splits, **opts), ref


@pytest.mark.parametrize("design", ["token", "layer"])
@pytest.mark.parametrize("block_size", [4, 12, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_tail(design, block_size, dtype):
    """Contexts of one token, under a block, a block, just over, several blocks."""
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 70]
    out, ref = decode_with_tail(lens, block_size, design, dtype, 1)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size,window,softcap", [(4, None, None), (12, 7, 4.0), (16, 20, None),
                                                       (4, 150, 3.0)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_tail_splits_window_softcap(block_size, window, softcap, num_splits):
    """Contexts past one 128-key fp8 tile, so several splits hold fp8 keys; windows inside the own block and over
    several blocks; GQA group 3."""
    lens = [5, 2 * block_size, 130, 300, 257]
    out, ref = decode_with_tail(lens, block_size, "token", torch.float32, num_splits, window, softcap,
                                heads=(6, 2), spare_blocks=40)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("lens", [[300], [5, 130]])
def test_decode_with_tail_few_programs(lens):
    """At most attention.DECODE_FP8_FEW_PROGRAMS (sequence, kv head) pairs on the tensor-core kernel (GQA group 3):
    its few-program key tile, over several splits, some without fp8 keys (the own block's split)."""
    assert len(lens) * 2 <= tk.DECODE_FP8_FEW_PROGRAMS
    for splits in (1, 4):
        out, ref = decode_with_tail(lens, 16, "token", torch.float32, splits, heads=(6, 2), spare_blocks=40)
        assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size,window", [(12, 5), (4, None)])
def test_decode_with_tail_every_context_length(block_size, window):
    """Each length 1..140 over 2 splits: the own block's start before, at and after the window's first 128-key tile,
    and fp8 ranges that fill no split, part of one, or both."""
    out, ref = decode_with_tail(list(range(1, 141)), block_size, "layer", torch.float32, 2, window, heads=(2, 1),
                                spare_blocks=40)
    assert_close(out, ref, torch.float32)


def test_decode_with_tail_padding_rows_give_zeros():
    lens = [9, 0, 20]
    for splits in (1, 2):
        out, ref = decode_with_tail(lens, 4, "token", torch.float32, splits, spare_blocks=40)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_close(out[[0, 2]], ref[[0, 2]], torch.float32)


def test_decode_reads_the_tail():
    """A tail that differs from the cache changes the output, as the oracle's; no tail: the fp8 cache's read."""
    lens = [3, 16, 37]
    out, ref = decode_with_tail(lens, 16, "token", torch.float32, 2, spare_blocks=10)
    changed, changed_ref = decode_with_tail(lens, 16, "token", torch.float32, 2, spare_blocks=10, change_tail=True)
    assert_close(changed, changed_ref, torch.float32)
    assert (changed - out).abs().amax() > 1e-2
    slots = [3 * i + 2 for i in range(len(lens))][::-1]
    st = TailState(lens, slots, 16, 2, 16, torch.float32, "token")
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    args = (q, *st.caches, st.tables[slots], st.context_lens, 0.25)
    plain = tk.decode_attention(*args, kv_scales=st.scales, num_splits=2)
    assert_close(plain, torch_ref.decode_attention(*args, kv_scales=st.scales), torch.float32)
    assert (plain - out).abs().amax() > 1e-4  # the exact keys are not the fp8 ones


def test_decode_tail_needs_slots():
    st = TailState([5], [0], 4, 2, 16, torch.float32, "token")
    q = torch.randn(1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slots"):
        tk.decode_attention(q, *st.caches, st.tables, st.context_lens, 0.25, kv_scales=st.scales, kv_tail=st.tail)


# --------------------------------------------------------------------------------------------- prefill


def prefill_with_tail(cached, new, slots, block_size, design, dtype, window=None, softcap=None, heads=(4, 2),
                      dim=32, seed=0, change_tail=False, tail=True):
    """(kernel, oracle) for one prompt step: sequence i's new tokens follow cached[i] cached ones; the tail holds the
    last two blocks before the step; the step's k/v are strided views of a packed qkv, equal to what was stored."""
    lens = [c + n for c, n in zip(cached, new)]
    st = TailState(lens, slots, block_size, heads[1], dim, dtype, design, tail_ends=cached, seed=seed)
    if change_tail:
        for t in st.tail:
            t.add_(1.0)
    total, (h, hkv) = sum(new), heads
    q = torch.randn(total, h, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    qkv = torch.cat([q.flatten(1), torch.cat([k[c:] for k, c in zip(st.k, cached)]).flatten(1),
                     torch.cat([v[c:] for v, c in zip(st.v, cached)]).flatten(1)], dim=1).to(DEVICE)
    q, k, v = (qkv[:, a * dim:b * dim].view(total, -1, dim) for a, b in ((0, h), (h, h + hkv),
                                                                         (h + hkv, h + 2 * hkv)))
    cu_q = torch.tensor([0] + list(new), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    step_slots = torch.cat([st.slot_of(s, torch.arange(c, c + n)) for s, c, n in zip(slots, cached, new)])
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=step_slots.to(DEVICE), context_lens=st.context_lens,
        block_tables=st.tables, cu_seqlens_q=cu_q.to(DEVICE), max_seqlen_q=max(new),
        has_cached_prefix=any(c > 0 for c in cached), query_lens_host=list(new), context_lens_host=lens,
        table_rows=torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    opts = dict(window=window, softcap=softcap, kv_scales=st.scales, **({"kv_tail": st.tail} if tail else {}))
    ref = torch_ref.prefill_attention(q, k, v, *st.caches, meta, dim ** -0.5, **opts)
    return tk.prefill_attention(q, k, v, *st.caches, meta, dim ** -0.5, **opts), ref


@pytest.mark.parametrize("design", ["token", "layer"])
@pytest.mark.parametrize("block_size", [4, 12, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_tail(design, block_size, dtype):
    """Chunks from the start, on a block boundary, inside a block (a cached prefix in the tail), one token; one over
    two query tiles; sequences in slots that are not 0..n-1."""
    cached = [0, block_size, block_size + 3, 2 * block_size - 1, 5]
    new = [9, block_size + 2, 40, 1, 2]
    out, ref = prefill_with_tail(cached, new, [4, 0, 6, 2, 7], block_size, design, dtype)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size,window,softcap", [(4, 6, None), (12, 5, 3.0), (16, 20, 4.0), (4, None, 2.0)])
def test_prefill_with_tail_window_softcap(block_size, window, softcap):
    out, ref = prefill_with_tail([0, 30, 7], [50, 20, 13], [1, 5, 3], block_size, "token", torch.float32, window,
                                 softcap, heads=(6, 2))
    assert_close(out, ref, torch.float32)


def test_prefill_reads_the_tail():
    """A tail that differs from the cache changes the rows whose block starts before the step, as the oracle's; no
    tail: the fp8 cache's read (the oracle's)."""
    args = ([6, 0], [5, 12], [2, 0], 4, "token", torch.float32)
    out, ref = prefill_with_tail(*args)
    changed, changed_ref = prefill_with_tail(*args, change_tail=True)
    assert_close(changed, changed_ref, torch.float32)
    assert (changed[:2] - out[:2]).abs().amax() > 1e-2  # positions 6, 7 read 4, 5 from the tail
    torch.testing.assert_close(changed[2:], out[2:], rtol=0, atol=0)  # no other row reads the tail
    plain, plain_ref = prefill_with_tail(*args, tail=False)
    assert_close(plain, plain_ref, torch.float32)
    assert (plain - out).abs().amax() > 1e-4


# --------------------------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@pytest.mark.parametrize("design", ["token", "layer"])
def test_gpu_decode_with_tail_real_shapes(design):
    out, ref = decode_with_tail([5000, 1, 257, 64, 4095, 16], 16, design, torch.bfloat16, None, heads=(32, 8),
                                dim=128)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_with_tail_in_a_cuda_graph():
    """Captured once, replayed over new queries and a new tail: the slots and the tail are read on the device."""
    lens, slots = [300, 17, 1000], [5, 1, 3]
    st = TailState(lens, slots, 16, 8, 128, torch.bfloat16, "token")
    q = torch.randn(len(lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
    slots_t = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    args = (q, *st.caches, st.tables[slots_t.long()], st.context_lens, 128 ** -0.5)
    opts = dict(kv_scales=st.scales, kv_tail=st.tail, slots=slots_t)
    tk.decode_attention(*args, **opts)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.decode_attention(*args, **opts)
    q.copy_(torch.randn_like(q))
    for t in st.tail:
        t.mul_(-1.0)
    graph.replay()
    assert_close(out, torch_ref.decode_attention(*args, **opts), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("design", ["token", "layer"])
def test_gpu_prefill_with_tail_real_shapes(design):
    out, ref = prefill_with_tail([0, 700, 31], [1024, 300, 97], [2, 0, 5], 16, design, torch.bfloat16,
                                 heads=(32, 8), dim=128)
    assert_close(out, ref, torch.bfloat16)
