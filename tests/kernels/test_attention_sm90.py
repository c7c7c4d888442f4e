"""The Gluon fp8 decode (kernels/attention_sm90.py) against the PyTorch oracle and the Triton kernel, over caches laid out
as the engine lays them out (V transposed within its blocks, per-token scales in (K, V) pairs) and written by the
store kernel. Hopper only (Gluon has no CPU interpreter; elsewhere supports() is False and the Triton kernels decode).
"""
import pytest
import torch

from nanoserve.kernels import attention as tk
from nanoserve.kernels import attention_sm90, kv_quant
from nanoserve.kernels import reference as torch_ref
from nanoserve.kernels.switches import switched
from nanoserve.runner.kv_cache import fp8_layout
from test_attention import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or attention_sm90.gluon is None,
    reason="needs a Hopper GPU and Triton's Gluon (3.6's API)")]

LENS = [1, 31, 32, 33, 700, 64, 5000, 2, 95]


def engine_case(lens, block_size, num_kv_heads, head_dim, tail, seed=0):
    """Sequences (slot i: lens[i] tokens) stored by store_kv into an fp8 cache in the engine's layout, with the tail
    holding each one's newest two blocks when `tail`: (k_cache, v_cache, scales, tables, context_lens, kv_tail)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-max(n, 1) // block_size) for n in lens]
    total = sum(blocks) + 1  # + the dummy block
    perm = torch.randperm(total - 1, generator=gen, device="cuda").int()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[at:at + n]
        at += n
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=kv_quant.FP8_DTYPE, device="cuda")
    scales = tuple(torch.zeros(shape[:3], dtype=kv_quant.TOKEN_SCALE_DTYPE, device="cuda") for _ in range(2))
    v_cache, scales = fp8_layout(torch.zeros(shape, dtype=kv_quant.FP8_DTYPE, device="cuda"), scales)
    rows = len(lens) * kv_quant.TAIL_BANKS * block_size
    kv_tail = tuple(torch.full((rows, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
                    for _ in range(2)) if tail else None
    for i, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        size = torch.exp2(torch.randint(-2, 2, (n, num_kv_heads, 1), generator=gen, device="cuda").float())
        k, v = ((torch.randn(n, num_kv_heads, head_dim, generator=gen, device="cuda") * size).bfloat16()
                for _ in range(2))
        slots = (tables[i, pos // block_size].long() * block_size + pos % block_size)
        recent = pos // block_size >= (n - 1) // block_size - 1
        tail_rows = torch.where(recent, kv_quant.tail_row(i, pos, block_size), -1) if tail else None
        tk.store_kv(k, v, k_cache, v_cache, slots, scales, kv_tail, tail_rows)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, scales, tables, lens_t, kv_tail


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (32, 8, 128), (8, 8, 64), (32, 4, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_gluon_decode_matches_the_oracle_and_triton(num_heads, num_kv_heads, head_dim, block_size, num_splits):
    k_cache, v_cache, scales, tables, lens, kv_tail = engine_case(LENS, block_size, num_kv_heads, head_dim, True)
    q = torch.randn(len(LENS), num_heads, head_dim, device="cuda").bfloat16()
    slots = torch.arange(len(LENS), dtype=torch.int32, device="cuda")
    assert attention_sm90.supports(q, k_cache, v_cache, scales, None, None, 1, kv_tail)
    args = (q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    extra = {"kv_scales": scales, "kv_tail": kv_tail, "slots": slots}
    out = tk.decode_attention(*args, num_splits=num_splits, **extra)
    assert_close(out, torch_ref.decode_attention(*args, **extra), torch.bfloat16)
    with switched(gluon_decode=False):
        assert_close(out, tk.decode_attention(*args, num_splits=num_splits, **extra), torch.bfloat16)


@pytest.mark.parametrize("q_size", [3e-4, 40.0, 2e5])
def test_gluon_decode_queries_of_any_size(q_size):
    """q reaches the fp16 product divided by a power of 2 that keeps it in fp16's range (2e5 would overflow it)."""
    k_cache, v_cache, scales, tables, lens, kv_tail = engine_case(LENS, 32, 8, 128, True, seed=4)
    q = (torch.randn(len(LENS), 32, 128, device="cuda") * q_size).bfloat16()
    args = (q, k_cache, v_cache, tables, lens, 128 ** -0.5 / max(q_size, 1.0))
    extra = {"kv_scales": scales, "kv_tail": kv_tail, "slots": torch.arange(len(LENS), dtype=torch.int32,
                                                                             device="cuda")}
    out = tk.decode_attention(*args, **extra)
    assert_close(out, torch_ref.decode_attention(*args, **extra), torch.bfloat16)


def test_gluon_decode_declines_what_it_does_not_read():
    k_cache, v_cache, scales, _tables, _lens, tail = engine_case([40], 32, 2, 128, True)
    q = torch.randn(1, 4, 128, device="cuda").bfloat16()
    ok = (None, None, 1, tail)
    assert attention_sm90.supports(q, k_cache, v_cache, scales, *ok)
    assert not attention_sm90.supports(q, k_cache, v_cache, scales, None, None, 1)  # no tail
    assert not attention_sm90.supports(q, k_cache, v_cache, scales, 16, None, 1, tail)  # a window
    assert not attention_sm90.supports(q, k_cache, v_cache, scales, None, 30.0, 1, tail)  # a softcap
    assert not attention_sm90.supports(q, k_cache, v_cache, (scales[0].clone(), scales[1].clone()), *ok)
    assert not attention_sm90.supports(q, k_cache, v_cache.contiguous(), scales, *ok)  # V token-major
    assert not attention_sm90.supports(q, k_cache, v_cache, (torch.ones(1), torch.ones(1)), *ok)  # per-layer
