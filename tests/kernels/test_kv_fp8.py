"""The fp8 KV cache's kernels vs their PyTorch oracles (kernels/kv_quant.py, kernels/reference.py): the stores give
the oracle's exact codes and scales, the reads (decode, paged prefill) its attention over the dequantized cache.

Without CUDA the kernels run in the Triton interpreter (small shapes); with CUDA the same cases compile for the GPU,
and the `gpu` cases add real shapes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from nanoserve.kernels import attention as tk  # noqa: E402
from nanoserve.kernels import kv_quant, rotary_kv  # noqa: E402
from nanoserve.kernels import reference as torch_ref  # noqa: E402
from nanoserve.runner.kv_cache import fp8_layout  # noqa: E402
from test_attention import DEVICE, PagedBatch, assert_close, prefill_case  # noqa: E402

if not torch.cuda.is_available() and type(tk._decode_kernel).__name__ != "InterpretedFunction":
    pytest.skip("kernels.attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

FP8 = kv_quant.FP8_DTYPE
DESIGNS = ["token", "layer"]


def fp8_cache(shape, design, device=DEVICE):
    """An empty fp8 cache [num_blocks, block_size, heads, dim] and its (k, v) scales of the given design, laid out as
    the engine's (V transposed within its blocks, per-token scales in (K, V) pairs: kv_cache.fp8_layout)."""
    caches = [torch.zeros(shape, dtype=FP8, device=device) for _ in range(2)]
    if design == "token":
        scales = tuple(torch.zeros(shape[:3], dtype=kv_quant.TOKEN_SCALE_DTYPE, device=device) for _ in range(2))
    else:
        scales = (torch.tensor([0.75], device=device), torch.tensor([1.5], device=device))
    v, scales = fp8_layout(caches[1], scales)
    return (caches[0], v), scales


def wide_values(shape, gen):
    """Values over e4m3's whole range and past it: subnormals, ties, an all-zero row, ±448 and beyond (clamped)."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-14, 10, shape, generator=gen).float())
    x[0, 0] = 0.0
    x[-1, -1, :4] = torch.tensor([1.0625, -0.0029296875, 500.0, -448.0])
    return x


def quantized_batch(batch: PagedBatch, design: str):
    """The batch's caches as fp8 codes with scales (NaN slots stay NaN codes and NaN scales: never to be read)."""
    out = []
    for cache in (batch.k_cache, batch.v_cache):
        if design == "token":
            codes, scale = kv_quant.quantize_ref(cache)
            scale = torch.where(cache.isnan().any(-1), torch.nan, scale.float()).to(scale.dtype)
        else:
            scale = torch.tensor([0.5], device=cache.device)
            codes, _ = kv_quant.quantize_ref(cache, scale)
        out.append((codes, scale))
    (kc, ks), (vc, vs) = out
    vc, scales = fp8_layout(vc, (ks, vs))
    return kc, vc, scales


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_gives_the_oracles_codes_and_scales(design, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim, block_size, blocks = 9, 3, 32, 4, 6
    k, v = (wide_values((tokens, heads, dim), gen).to(dtype).to(DEVICE) for _ in range(2))
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    (kc, vc), scales = fp8_cache((blocks, block_size, heads, dim), design)
    (rkc, rvc), rscales = fp8_cache((blocks, block_size, heads, dim), design)
    tk.store_kv(k, v, kc, vc, slots, scales)
    torch_ref.store_kv(k, v, rkc, rvc, slots, rscales)
    assert torch.equal(kc.view(torch.uint8), rkc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8))
    for s, r in zip(scales, rscales):
        assert torch.equal(s, r)
    if design == "token":  # the scale is the row's amax / 448 (in bf16), so some code of each row is near ±448
        codes = kc.view(-1, heads, dim)[slots.long()].float()
        assert (codes.abs().amax(-1)[k.float().abs().amax(-1) > 0] >= 440).all()


def test_codes_round_to_nearest_even_like_torch():
    """Every e4m3 value and every midpoint between neighbours, through the store (layer scale 1)."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, torch.tensor([449.0, -460.0, 1e-4, -1e-4])])
    n = x.numel()
    k = x.view(n, 1, 1).expand(n, 1, 16).contiguous().to(DEVICE)
    (kc, vc), _ = fp8_cache((n, 1, 1, 16), "layer")
    one = (torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE))
    tk.store_kv(k, k, kc, vc, torch.arange(n, device=DEVICE), one)
    want = x.clamp(-448, 448).to(FP8)
    assert torch.equal(kc[:, 0, 0, 0].cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("design", DESIGNS)
def test_fused_rotary_store_quantizes_the_rotated_k(design):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim, rotary, block_size, blocks = 7, 4, 2, 32, 32, 4, 5
    q = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = (torch.randn(tokens, kv_heads, dim, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    cos_sin = torch.randn(64, 2 * rotary, generator=gen).to(torch.bfloat16).to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    (kc, vc), scales = fp8_cache((blocks, block_size, kv_heads, dim), design)
    _q, k_out = rotary_kv.qk_norm_rope(q, k, cos_sin, positions, kv_store=(v, kc, vc, slots, scales))
    (rkc, rvc), rscales = fp8_cache((blocks, block_size, kv_heads, dim), design)
    torch_ref.store_kv(k_out, v, rkc, rvc, slots, rscales)  # the oracle stores the kernel's own rotated k
    assert torch.equal(kc.view(torch.uint8), rkc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8))
    assert all(torch.equal(s, r) for s, r in zip(scales, rscales))


def test_fused_rotary_store_writes_the_tail_rows():
    """The rotary kernel also writes each token's rotated k and its v, in the model's dtype, at its tail row (-1:
    none), as the oracle's store_tail does; the rest of the tail is left as it was."""
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim, block_size = 6, 4, 2, 32, 4
    q = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    cos_sin = torch.randn(64, 2 * dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([3, 4, 5, 9, 10, 2], device=DEVICE)
    slots = torch.arange(tokens, device=DEVICE) + 8
    rows = torch.tensor([-1, 5, 6, 20, -1, 2], dtype=torch.int32, device=DEVICE)
    (kc, vc), scales = fp8_cache((4, block_size, kv_heads, dim), "token")
    tails = [torch.full((3 * kv_quant.TAIL_BANKS * block_size, kv_heads, dim), 7.0, dtype=torch.bfloat16,
                        device=DEVICE) for _ in range(2)]
    _q, k_out = rotary_kv.qk_norm_rope(q, k, cos_sin, positions, kv_store=(v, kc, vc, slots, scales, tails, rows))
    want = [torch.full_like(t, 7.0) for t in tails]
    torch_ref.store_tail(k_out, v, want, rows)
    assert all(torch.equal(t, w) for t, w in zip(tails, want))


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("lens", [[100], [3], [64, 1], [100, 3, 64, 1, 17, 9, 33, 2, 50]])
def test_decode_reads_fp8_few_programs(design, lens):
    """Few (sequence, kv head) programs: at most DECODE_FP8_FEW_PROGRAMS the tensor-core kernel's few-programs tiles;
    more but fewer than a GPU's SMs the CUDA-core kernel's sparse tiles (DECODE_LANES_ROWS_SPARSE rows; the
    interpreter's 4 "SMs" take its dense ones); both split over the context."""
    batch = PagedBatch(lens, 16, 1, 64, torch.bfloat16, seed=5)
    kc, vc, scales = quantized_batch(batch, design)
    q = torch.randn(len(lens), 2, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    args = (q, kc, vc, batch.block_tables, batch.context_lens, 0.125)
    assert_close(tk.decode_attention(*args, kv_scales=scales), torch_ref.decode_attention(*args, kv_scales=scales),
                 torch.bfloat16)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("num_heads", [8, 4, 2])
@pytest.mark.parametrize("num_splits,window,softcap,block_size", [(None, None, None, 16), (3, None, None, 16),
                                                                  (2, 24, 30.0, 16), (None, None, None, 12)])
def test_decode_reads_fp8(design, num_heads, num_splits, window, softcap, block_size):
    """block_size 12: the key tile does not hold whole blocks, so V is loaded key by key. 8 heads over 2 kv heads:
    the tensor-core kernel; 4 and 2: the CUDA-core one (attention.DECODE_LANES_MAX_GROUP; 10 programs, more than
    DECODE_FP8_FEW_PROGRAMS)."""
    batch = PagedBatch([1, 17, 70, 33, 5], block_size, 2, 64, torch.bfloat16, seed=3)
    kc, vc, scales = quantized_batch(batch, design)
    q = torch.randn(5, num_heads, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    args = (q, kc, vc, batch.block_tables, batch.context_lens, 0.125)
    opts = dict(window=window, softcap=softcap, kv_scales=scales)
    out = tk.decode_attention(*args, num_splits=num_splits, **opts)
    assert_close(out, torch_ref.decode_attention(*args, **opts), torch.bfloat16)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("cached_lens,query_lens,window", [([0, 0], [19, 40], None), ([21, 0, 5], [13, 30, 1], None),
                                                           ([37], [20], 16)])
def test_paged_prefill_reads_fp8(design, cached_lens, query_lens, window):
    q, _k, _v, batch, meta = prefill_case(cached_lens, query_lens, 4, 2, 32, 8, torch.bfloat16, seed=5)
    kc, vc, scales = quantized_batch(batch, design)
    out = tk.prefill_attention(q, None, None, kc, vc, meta, 0.2, window=window, kv_scales=scales)
    ref = torch_ref.prefill_attention(q, None, None, kc, vc, meta, 0.2, window=window, kv_scales=scales)
    assert_close(out, ref, torch.bfloat16)


def test_scales_must_match_the_cache():
    (kc, vc), scales = fp8_cache((3, 4, 2, 16), "token")
    k = torch.randn(2, 2, 16, device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="needs its K and V scales"):
        tk.store_kv(k, k, kc, vc, slots)
    with pytest.raises(ValueError, match="do not match the cache"):
        tk.store_kv(k, k, kc, vc, slots, (scales[0][:2], scales[1][:2]))
    bf = torch.zeros(3, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="belong to an fp8 one"):
        tk.store_kv(k, k, bf, bf, slots, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("num_heads,num_kv_heads,max_context,copies", [(32, 8, 5000, 1), (16, 8, 600, 1),
                                                                        (16, 8, 600, 4), (64, 4, 2048, 1)])
def test_gpu_decode_fp8_real_shapes(design, num_heads, num_kv_heads, max_context, copies):
    """copies 4: 24 rows of 8 kv heads fill the SMs, so the CUDA-core kernel takes its dense tiles."""
    lens = [max_context, max_context // 3, 1, 257, 64, max_context - 1] * copies
    batch = PagedBatch(lens, 16, num_kv_heads, 128, torch.bfloat16, seed=7)
    kc, vc, scales = quantized_batch(batch, design)
    q = torch.randn(len(lens), num_heads, 128, device=DEVICE, dtype=torch.bfloat16)
    args = (q, kc, vc, batch.block_tables, batch.context_lens, 128 ** -0.5)
    assert_close(tk.decode_attention(*args, kv_scales=scales),
                 torch_ref.decode_attention(*args, kv_scales=scales), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("design", DESIGNS)
def test_gpu_prefill_fp8_real_shapes(design):
    q, _k, _v, batch, meta = prefill_case([0, 700, 31], [1024, 300, 97], 32, 8, 128, 16, torch.bfloat16, seed=9)
    kc, vc, scales = quantized_batch(batch, design)
    out = tk.prefill_attention(q, None, None, kc, vc, meta, 128 ** -0.5, kv_scales=scales)
    assert_close(out, torch_ref.prefill_attention(q, None, None, kc, vc, meta, 128 ** -0.5, kv_scales=scales),
                 torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("design", DESIGNS)
def test_gpu_store_fp8_real_shapes(design):
    gen = torch.Generator().manual_seed(11)
    k, v = (wide_values((2048, 8, 128), gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    slots = torch.randperm(4096, generator=gen)[:2048].to(DEVICE)
    (kc, vc), scales = fp8_cache((256, 16, 8, 128), design)
    (rkc, rvc), rscales = fp8_cache((256, 16, 8, 128), design)
    tk.store_kv(k, v, kc, vc, slots, scales)
    torch_ref.store_kv(k, v, rkc, rvc, slots, rscales)
    assert torch.equal(kc.view(torch.uint8), rkc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8))
    assert all(torch.equal(s, r) for s, r in zip(scales, rscales))
