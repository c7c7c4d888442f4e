"""The one-launch skinny-matmul kernel == F.linear (CPU through TRITON_INTERPRET=1, set in conftest; CUDA when present)."""
import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import fused, gemv
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.gemv import GemvConfig

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

FMA_SPLIT = GemvConfig(block_n=8, block_k=32, split_k=3)
FMA_WHOLE_K = GemvConfig(block_n=8, block_k=64, programs_per_sm=0)
DOT_SPLIT = GemvConfig(block_n=16, block_k=32, use_dot=True, split_k=4)
DOT_WHOLE_K = GemvConfig(block_n=16, block_k=64, use_dot=True, programs_per_sm=0)


def make(m, n, k, dtype, bias, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


def check(out, x, w, b):
    """fp32: tight; half types: one rounding of the fp32 result (the kernel accumulates in fp32)."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    else:
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


# -- the kernel on CPU (interpreter) or GPU ---------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [FMA_SPLIT, FMA_WHOLE_K], ids=["fma-split", "fma"])
@pytest.mark.parametrize("m", [1, 3])
def test_fma_path(m, config, bias, dtype):
    x, w, b = make(m, 37, 200, dtype, bias)  # odd N, K not a multiple of block_k
    check(gemv.linear(x, w, b, force_triton=True, config=config), x, w, b)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [DOT_SPLIT, DOT_WHOLE_K], ids=["dot-split", "dot"])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_dot_path(m, config, bias, dtype):
    x, w, b = make(m, 37, 192, dtype, bias, seed=m)  # K a multiple of block_k: the unmasked loads
    check(gemv.linear(x, w, b, force_triton=True, config=config), x, w, b)


@needs_triton
@pytest.mark.parametrize("m", [8, 16])
def test_fma_path_many_rows(m):
    x, w, b = make(m, 21, 64, torch.float32, True, seed=m)
    check(gemv.linear(x, w, b, force_triton=True, config=GemvConfig(block_n=8, block_k=32, split_k=2)), x, w, b)


@needs_triton
def test_default_configs_and_strided_x():
    for m in (1, 8):  # the FMA default, then the dot default
        x, w, b = make(m, 40, 128, torch.float32, True, seed=m)
        check(gemv.linear(x, w, b, force_triton=True), x, w, b)
    wide = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = wide[:, 64:192]  # row stride 256, unit column stride: used in place
    _, w, _ = make(3, 40, 128, torch.float32, False)
    check(gemv.linear(x, w, force_triton=True, config=FMA_SPLIT), x, w, None)


@needs_triton
def test_split_k_counters_are_reset_and_result_is_deterministic():
    x, w, b = make(3, 37, 200, torch.float32, True)
    device = torch.device(DEVICE)
    first = gemv.linear(x, w, b, force_triton=True, config=DOT_SPLIT)
    counters = gemv._counters[device]
    assert int(counters.count_nonzero()) == 0, "the last program of each tile must reset its counter"
    second = gemv.linear(x, w, b, force_triton=True, config=DOT_SPLIT)  # reuses the same counters
    assert gemv._counters[device] is counters and int(counters.count_nonzero()) == 0
    assert torch.equal(first, second)  # partials are summed in split order, not arrival order
    check(second, x, w, b)
    x2, w2, _ = make(2, 50, 96, torch.float32, False, seed=9)  # another shape through the same slots
    check(gemv.linear(x2, w2, force_triton=True, config=FMA_SPLIT), x2, w2, None)


@needs_triton
def test_force_triton_rejects_too_many_rows():
    x, w, _ = make(gemv.MAX_M + 1, 8, 32, torch.float32, False)
    with pytest.raises(ValueError, match="rows"):
        gemv.linear(x, w, force_triton=True)


# -- host-side logic (no kernel) ----------------------------------------------------------------------
def test_plan_splits_k_to_fill_the_gpu_without_empty_slices():
    cfg = GemvConfig(block_n=8, block_k=512, programs_per_sm=2)
    p = gemv.plan(cfg, 1, 1024, 2048, 132)  # 128 tiles want 264 programs: 3 splits of 4 K blocks → 2 x 1024
    assert (p.n_tiles, p.split_k, p.k_per_split, p.block_m) == (128, 2, 1024, 1)
    assert p.split_k * p.k_per_split >= 2048 > (p.split_k - 1) * p.k_per_split
    assert gemv.plan(cfg, 1, 28672, 4096, 132).split_k == 1  # enough tiles already
    assert gemv.plan(GemvConfig(8, 512, programs_per_sm=0), 1, 8, 1 << 20, 132).split_k == 1
    assert gemv.plan(GemvConfig(8, 64, split_k=100), 1, 8, 1 << 20, 132).split_k == gemv.MAX_SPLIT_K
    assert gemv.plan(GemvConfig(8, 64, split_k=8), 1, 8, 100, 132).split_k == 2  # only 2 K blocks
    p = gemv.plan(GemvConfig(16, 256, use_dot=True), 5, 100, 40, 132)
    assert (p.block_m, p.block_k, p.split_k) == (16, 64, 1)  # M padded to 16, K block shrunk to K


def test_plan_without_counter_slots_does_not_split():
    cfg = GemvConfig(block_n=1, block_k=16, split_k=4)
    assert gemv.plan(cfg, 1, gemv.COUNTER_SLOTS + 1, 1024, 132).split_k == 1


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=12, block_k=256)
    with pytest.raises(ValueError, match="tl.dot"):
        GemvConfig(block_n=8, block_k=256, use_dot=True)
    assert not gemv.default_config(1, 1024, 1024).use_dot and gemv.default_config(16, 1024, 1024).use_dot


def test_linear_falls_back_off_gpu_and_without_triton(monkeypatch):
    x, w, b = make(2, 24, 64, torch.float32, True, device="cpu")
    assert not gemv.kernel_applies(x, w, b)  # CPU tensors: F.linear
    torch.testing.assert_close(gemv.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    monkeypatch.setattr(gemv, "HAS_TRITON", False)
    torch.testing.assert_close(gemv.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not installed"):
        gemv.linear(x, w, b, force_triton=True)


# -- GPU: real shapes, the auto rule, CUDA graphs -----------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
REAL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 14336)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", REAL_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_gpu_real_shapes_default_and_split_variants(m, n, k):
    x, w, b = make(m, n, k, torch.bfloat16, True, seed=n + m)
    check(gemv.linear(x, w, b, force_triton=True), x, w, b)
    for cfg in (GemvConfig(8, 256, split_k=4), GemvConfig(32, 256, use_dot=True, split_k=3),
                GemvConfig(16, 512, programs_per_sm=0)):
        check(gemv.linear(x, w, None, force_triton=True, config=cfg), x, w, None)


def test_auto_rule_follows_the_h200_measurements():
    assert gemv.auto_applies(1, 1024, 2048, 2)  # Qwen3-0.6B o_proj, one row: 3.5 vs 12.8 µs
    assert gemv.auto_applies(1, 4096, 14336, 2)  # Llama-3.1-8B down (117 MB): 28.7 vs 31.3 µs
    assert not gemv.auto_applies(1, 28672, 4096, 2)  # Llama gate_up (235 MB): cuBLAS already at copy speed
    assert gemv.auto_applies(2, 1024, 2048, 2)  # two rows of a small matrix
    assert not gemv.auto_applies(2, 6144, 4096, 2)  # two rows of a larger one: a tie, cuBLAS keeps it
    assert not gemv.auto_applies(4, 1024, 2048, 2)
    assert gemv.default_config(1, 1024, 2048) == gemv.FMA_SMALL_CONFIG
    assert gemv.default_config(1, 4096, 14336) == gemv.FMA_CONFIG
    assert gemv.default_config(8, 4096, 4096) == gemv.DOT_CONFIG


@pytest.mark.gpu
@needs_gpu
def test_gpu_auto_rule():
    x, w, b = make(1, 4096, 1024, torch.bfloat16, True)  # 8 MiB of weight, one row
    assert gemv.kernel_applies(x, w, b)
    with torch.inference_mode():
        check(gemv.linear(x, w, b), x, w, b)
    assert not gemv.kernel_applies(torch.cat([x] * 4), w, b)  # 4 rows: cuBLAS
    assert not gemv.kernel_applies(x.float(), w.float(), None)  # fp32: cuBLAS
    assert not gemv.kernel_applies(x, w, b.float())  # F.linear would reject the mixed dtypes
    assert not gemv.kernel_applies(x[:, :1000].contiguous(), w[:, :1000].contiguous(), b)  # K % 16
    assert not gemv.kernel_applies(x, w.t().contiguous().t(), b)  # weight not contiguous
    assert not gemv.kernel_applies(x.requires_grad_(), w, b)  # grad mode and a tensor that wants grads


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fresh_counters", [False, True])
def test_gpu_cuda_graph_replays_split_k(fresh_counters, monkeypatch):
    """Replays reuse the persistent counters; without them at capture time the unsplit variant is captured."""
    if fresh_counters:
        monkeypatch.setattr(gemv, "_counters", {})
    x, w, b = make(3, 1024, 2048, torch.bfloat16, True, seed=3)
    cfg = GemvConfig(8, 256, split_k=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if not fresh_counters:
            gemv.linear(x, w, b, force_triton=True, config=cfg)  # warm-up: compiles, creates counters
    torch.cuda.current_stream().wait_stream(stream)
    if fresh_counters:  # compile outside the capture, but leave the counters missing
        gemv.linear(x, w, b, force_triton=True, config=GemvConfig(8, 256, split_k=1))
        monkeypatch.setattr(gemv, "_counters", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w, b, force_triton=True, config=cfg)
    for seed in (10, 11, 12):
        x.copy_(make(3, 1024, 2048, torch.bfloat16, False, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w, b)
    if fresh_counters:
        assert gemv._counters == {}, "no counter buffer may be allocated from the graph's pool"
    else:
        assert int(gemv._counters[x.device].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_equals_rms_norm_then_linear(dtype, with_residual):
    g = torch.Generator().manual_seed(11)
    n, k = 40, 96  # K not a multiple of the tile; N not of block_n
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_w = torch.randn(k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    out, new_residual = gemv.norm_linear(x, residual, norm_w, 1e-6, w, b, force_triton=True)
    if residual is None:
        normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-6), x
    else:
        normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-6, residual)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, F.linear(normed, w, b), **tol)
    torch.testing.assert_close(new_residual, want_residual, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_prologue_equals_silu_and_mul_then_linear(dtype):
    g = torch.Generator().manual_seed(12)
    n, k = 24, 80
    gate_up = torch.randn(1, 2 * k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    out = gemv.silu_mul_linear(gate_up, w, force_triton=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, F.linear(fused.silu_and_mul_ref(gate_up), w), **tol)


def test_prologues_fall_back_for_several_rows():
    x = torch.randn(3, 64)
    w = torch.randn(8, 64)
    out, residual = gemv.norm_linear(x, None, torch.ones(64), 1e-6, w)  # CPU, 3 rows: the unfused path
    torch.testing.assert_close(out, F.linear(fused.rms_norm_ref(x, torch.ones(64), 1e-6), w))
    assert residual is x
    with pytest.raises(ValueError, match="one row"):
        gemv.silu_mul_linear(torch.randn(3, 128), w, force_triton=True)
