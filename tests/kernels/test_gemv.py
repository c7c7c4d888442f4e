"""The one-launch few-row GEMV == F.linear, and its fused paths == the unfused ops they replace.

CPU: through TRITON_INTERPRET=1 (set in conftest); with CUDA the same cases compile for the GPU, and the
`gpu` tests add real decode shapes, programmatic dependent launch and CUDA-graph replay.
"""
import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import attention, fp8, fused, gemv
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.gemv import GemvConfig
from nanoserve.kernels.rotary_kv import QKVRope, qk_norm_rope_ref
from nanoserve.kernels.switches import switched

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


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def exact_on_gpu(dtype):
    """The same rounded values as the unfused op: exact on the GPU; the CPU interpreter's fp32 → bf16 cast does
    not round like torch's, so there one rounding apart."""
    return dict(rtol=0, atol=0) if DEVICE == "cuda" or dtype == torch.float32 else tol(dtype)


# -- the plain product on CPU (interpreter) or GPU ------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [FMA_SPLIT, FMA_WHOLE_K], ids=["fma-split", "fma"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.usefixtures("force_triton")
def test_fma_path(m, config, bias, dtype):
    x, w, b = make(m, 37, 200, dtype, bias)  # odd N, K not a multiple of block_k
    check(gemv.linear(x, w, b, config=config), x, w, b)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [DOT_SPLIT, DOT_WHOLE_K], ids=["dot-split", "dot"])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
@pytest.mark.usefixtures("force_triton")
def test_dot_path(m, config, bias, dtype):
    x, w, b = make(m, 37, 192, dtype, bias, seed=m)  # K a multiple of block_k: the unmasked loads
    check(gemv.linear(x, w, b, config=config), x, w, b)


@needs_triton
@pytest.mark.parametrize("m", [8, 16])
@pytest.mark.usefixtures("force_triton")
def test_fma_path_many_rows(m):
    x, w, b = make(m, 21, 64, torch.float32, True, seed=m)
    check(gemv.linear(x, w, b, config=GemvConfig(block_n=8, block_k=32, split_k=2)), x, w, b)


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_table_configs_and_strided_x():
    for m in (1, 8, 40):  # the table's fma variant, then its dot variants
        x, w, b = make(m, 40, 128, torch.float32, True, seed=m)
        check(gemv.linear(x, w, b), x, w, b)
    wide = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = wide[:, 64:192]  # row stride 256, unit column stride: used in place
    _, w, _ = make(3, 40, 128, torch.float32, False)
    check(gemv.linear(x, w, config=FMA_SPLIT), x, w, None)


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_split_k_counters_are_reset_and_result_is_deterministic():
    x, w, b = make(3, 37, 200, torch.float32, True)
    first = gemv.linear(x, w, b, config=DOT_SPLIT)
    counters = gemv._counters[x.device]
    assert int(counters.count_nonzero()) == 0, "the last program of each tile must reset its counter"
    second = gemv.linear(x, w, b, config=DOT_SPLIT)  # reuses the same counters
    assert gemv._counters[x.device] is counters and int(counters.count_nonzero()) == 0
    assert torch.equal(first, second)  # partials are summed in split order, not arrival order
    check(second, x, w, b)
    x2, w2, _ = make(2, 50, 96, torch.float32, False, seed=9)  # another shape through the same slots
    check(gemv.linear(x2, w2, config=FMA_SPLIT), x2, w2, None)


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_too_many_rows_are_refused():
    x, w, _ = make(gemv.MAX_M + 1, 8, 32, torch.float32, False)
    with pytest.raises(ValueError, match="rows"):
        gemv.linear(x, w)
    x, w, _ = make(gemv.FMA_MAX_ROWS + 1, 8, 32, torch.float32, False)
    with pytest.raises(ValueError, match="dot config"):
        gemv.linear(x, w, config=FMA_SPLIT)


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
    assert gemv.plan(GemvConfig(16, 256, use_dot=True), 33, 100, 256, 132).block_m == 64


def test_plan_cuts_the_pipeline_to_the_shared_memory():
    cfg = GemvConfig(64, 128, num_stages=4, use_dot=True)
    assert gemv.plan(cfg, 64, 4096, 4096, 132).num_stages == 4  # (64 + 64) x 128 bf16: 32 KiB a stage
    assert gemv.plan(cfg, 64, 4096, 4096, 132, element_size=4).num_stages == 2  # fp32: 64 KiB a stage
    assert gemv.plan(GemvConfig(64, 256, num_stages=3, use_dot=True), 64, 4096, 4096, 132).num_stages == 2


def test_plan_without_counter_slots_does_not_split():
    cfg = GemvConfig(block_n=1, block_k=16, split_k=4)
    assert gemv.plan(cfg, 1, gemv.COUNTER_SLOTS + 1, 1024, 132).split_k == 1


def test_config_validation_and_names():
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=12, block_k=256)
    with pytest.raises(ValueError, match="tl.dot"):
        GemvConfig(block_n=8, block_k=256, use_dot=True)
    for cfg in (FMA_SPLIT, DOT_WHOLE_K, GemvConfig(32, 256, 8, 2, True, 0.5)):
        assert GemvConfig.parse(cfg.short()) == cfg
    with pytest.raises(ValueError, match="bad GEMV config"):
        GemvConfig.parse("fma 8 w4 st3 p0")


def test_dispatch_table():
    """choose() reads GEMV_TABLE: the bucket is the smallest row count >= M, the entry the first size bound."""
    for m in (1, 2, 3, 5, 17, 33, 64):
        cfg, _ = gemv.choose(m, 1024, 1024, 2)
        assert gemv.plan(cfg, m, 1024, 1024, 132)  # every bucket's variant handles its rows
    assert gemv.choose(1, 1024, 2048, 2)[1]  # Qwen3-0.6B o_proj, one row: the kernel (3.5 vs 12.8 µs)
    mib = 151936 * 1024 * 2 / 2**20  # a 311 MB lm_head at one row: whatever the table's last-but-one bound says
    entry = next(e for e in gemv.GEMV_TABLE[1] if e[0] is None or mib <= e[0])
    assert gemv.choose(1, 151936, 1024, 2)[1] == (entry[2] == gemv.TRITON)
    with pytest.raises(ValueError, match="rows"):
        gemv.choose(gemv.MAX_M + 1, 8, 16, 2)
    with pytest.raises(ValueError, match="ascend"):
        gemv._parsed_table({1: ((8, "fma 4x1024 w4 st3 p0", "triton"),)})  # no entry for any size
    with pytest.raises(ValueError, match="winners"):
        gemv._parsed_table({1: ((None, "fma 4x1024 w4 st3 p0", "cuda"),)})


def test_dispatch_shapes():
    """A GEMV_SHAPES entry wins over the size rule for its exact shape and rows bucket only (fp8 weights excluded);
    entries are checked when parsed."""
    (rows, n, k), (short, winner) = next(iter(gemv.GEMV_SHAPES.items()))
    for m in range(1, rows + 1):
        if gemv._bucket(m, gemv._TABLE) == rows:
            assert gemv.choose(m, n, k, 2) == (GemvConfig.parse(short), winner == gemv.TRITON)
    by_size = next(c for lim, c, _ in gemv._TABLE[rows] if n * (k + 16) * 2 <= lim)
    assert gemv.choose(rows, n, k + 16, 2)[0] == by_size  # another shape: the size rule
    fp8_rule = gemv._FP8_TABLE[gemv._bucket(rows, gemv._FP8_TABLE)]
    assert gemv.choose(rows, n, k, 1)[0] == next(c for lim, c, _ in fp8_rule if n * k <= lim)  # fp8: its own table
    with pytest.raises(ValueError, match="bucket"):
        gemv._parsed_shapes({(3, 8, 16): ("fma 4x1024 w4 st3 p0", gemv.TRITON)})


def test_linear_falls_back_off_gpu_and_without_triton(monkeypatch):
    x, w, b = make(2, 24, 64, torch.float32, True, device="cpu")
    assert not gemv.kernel_applies(x, w, b)  # CPU tensors: F.linear
    torch.testing.assert_close(gemv.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    monkeypatch.setattr(gemv, "HAS_TRITON", False)
    torch.testing.assert_close(gemv.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    with switched(force_triton=True), pytest.raises(RuntimeError, match="not installed"):
        gemv.linear(x, w, b)


# -- fused prologues: residual add + RMSNorm; act-and-mul ------------------------------------------------
def norm_case(m, k, n, dtype, with_residual, seed=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    residual = torch.randn(m, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_w = torch.randn(k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    return x, residual, norm_w, w, b


def check_norm_linear(m, dtype, with_residual, config):
    x, residual, norm_w, w, b = norm_case(m, 96, 40, dtype, with_residual)  # K, N not multiples of the tiles
    out, new_residual = gemv.norm_linear(x, residual, norm_w, 1e-6, w, b, config=config)
    if residual is None:
        normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-6), x
        assert new_residual is x
    else:
        normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-6, residual)
    torch.testing.assert_close(out, F.linear(normed, w, b), **tol(dtype))
    torch.testing.assert_close(new_residual, want_residual, **exact_on_gpu(dtype))  # the same rounded sum


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m,config", [(1, None), (1, FMA_SPLIT), (3, FMA_SPLIT), (3, DOT_SPLIT), (20, None)])
@pytest.mark.usefixtures("force_triton")
def test_norm_prologue_equals_rms_norm_then_linear(m, config, dtype, with_residual):
    check_norm_linear(m, dtype, with_residual, config)


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,config", [(1, FMA_SPLIT), (3, FMA_WHOLE_K), (20, DOT_SPLIT)])
@pytest.mark.usefixtures("force_triton")
def test_act_mul_linear_equals_act_mul_then_linear(m, config, dtype, activation):
    """The MLP's down projection: act(gate) · up (SwiGLU or GeGLU) feeds the one-row and multi-row kernels."""
    x, _, _, w, b = norm_case(m, 2 * 96, 40, dtype, False)
    out = gemv.silu_mul_linear(x, w[:, :96].contiguous(), b, config=config, activation=activation)
    torch.testing.assert_close(out, F.linear(fused.silu_and_mul_ref(x, activation), w[:, :96], b), **tol(dtype))


def test_act_mul_linear_refuses_an_unknown_activation():
    with pytest.raises(ValueError, match="relu"):
        gemv.silu_mul_linear(torch.zeros(1, 64), torch.zeros(8, 32), activation="relu")


def test_prologues_unfused_off_gpu_or_switched_off():
    x = torch.randn(3, 64)
    w = torch.randn(8, 64)
    out, residual = gemv.norm_linear(x, None, torch.ones(64), 1e-6, w)  # CPU: the unfused path
    torch.testing.assert_close(out, F.linear(fused.rms_norm_ref(x, torch.ones(64), 1e-6), w))
    assert residual is x
    with switched(fuse_norm=False):
        assert not gemv._fuses(gemv.SWITCHES.fuse_norm, x, w, None)


NORM_PATHS = {"prologue": (True, FMA_SPLIT, None), "norm kernel": (False, None, None),
              "dot8q": (True, GemvConfig.parse("dot8q 16x32 w4 st2 s3"), (None,))}


@needs_triton
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("path", list(NORM_PATHS))
def test_norm_linear_with_an_owed_post_norm_equals_post_norm_first(path, with_residual):
    """x_norm on every path of norm_linear (the GEMV prologue: a launch of its own first; the separate norm kernel,
    which is the reference off the GPU, and the W8A8 norm kernel: inside it) gives bit for bit what applying the
    post-norm first gives (in fp32 on the GPU to fp32's last bits: test_fused says why)."""
    force, config, fp8_weight = NORM_PATHS[path]
    x, residual, norm_w, w, b = norm_case(1 if force else 3, 96, 40, torch.float32, with_residual)
    x = x * 20  # a sub-layer's output, far from unit rms
    x_norm = (torch.linspace(0.5, 2, 96, device=DEVICE), 1e-5)
    weight, scale = fp8.quantize(w) if fp8_weight else (w, None)
    with switched(force_triton=force):
        got = gemv.norm_linear(x, residual, norm_w, 1e-6, weight, b, weight_scale=scale, config=config,
                               x_norm=x_norm)
        want = gemv.norm_linear(fused.rms_norm(x, *x_norm), residual, norm_w, 1e-6, weight, b, weight_scale=scale,
                                config=config)
    if x.is_cuda and path != "prologue":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- norm + qkv + rope (the attention input) --------------------------------------------------------------
def rope_case(m, dtype, qk_norm, bias, heads=4, kv_heads=2, d=32, hidden=64, seed=3, rotary_dim=None):
    g = torch.Generator().manual_seed(seed)
    dev = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    x, residual = dev(torch.randn(m, hidden, generator=g)), dev(torch.randn(m, hidden, generator=g))
    norm_w = dev(torch.randn(hidden, generator=g))
    width = (heads + 2 * kv_heads) * d
    w = dev(torch.randn(width, hidden, generator=g) / hidden ** 0.5)
    b = dev(torch.randn(width, generator=g)) if bias else None
    angles = torch.rand(64, (rotary_dim or d) // 2, generator=g) * 6
    cos_sin = dev(torch.cat([angles.cos(), angles.cos(), -angles.sin(), angles.sin()], dim=-1))
    positions = torch.randint(0, 64, (m,), generator=g).to(DEVICE)
    slots = torch.randperm(8 * 4, generator=g)[:m].to(DEVICE, torch.int32)

    def rope():
        caches = [torch.zeros(8, 4, kv_heads, d, device=DEVICE, dtype=dtype) for _ in range(2)]
        r = QKVRope(heads, kv_heads, d, cos_sin, positions, caches[0], caches[1], slots)
        if qk_norm:
            r.q_norm_weight, r.k_norm_weight = dev(torch.randn(d, generator=g)), dev(torch.randn(d, generator=g))
        return r
    return x, residual, norm_w, w, b, rope


def rope_reference(x, residual, norm_w, w, b, rope: QKVRope):
    normed, new_residual = fused.rms_norm_ref(x, norm_w, 1e-6, residual)
    q, k, v = rope.split(F.linear(normed, w, b))
    q, _ = qk_norm_rope_ref(q, k, rope.cos_sin_cache, rope.positions, rope.q_norm_weight, rope.k_norm_weight,
                            rope.eps, kv_store=(v, rope.k_cache, rope.v_cache, rope.slot_mapping, None))
    return q, new_residual


def check_norm_qkv_rope(m, dtype, qk_norm, bias, **shape):
    x, residual, norm_w, w, b, make_rope = rope_case(m, dtype, qk_norm, bias, **shape)
    ref_rope = make_rope()
    rope = QKVRope(**{**ref_rope.__dict__, "k_cache": ref_rope.k_cache.clone(), "v_cache": ref_rope.v_cache.clone()})
    q_ref, residual_ref = rope_reference(x, residual, norm_w, w, b, ref_rope)
    q, k, v, new_residual = gemv.norm_qkv_rope(x, residual, norm_w, 1e-6, w, b, rope)
    assert q.shape == q_ref.shape and k.shape == v.shape
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(rope.k_cache, ref_rope.k_cache, **tol(dtype))
    torch.testing.assert_close(rope.v_cache, ref_rope.v_cache, **tol(dtype))
    torch.testing.assert_close(new_residual, residual_ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,bias", [(True, False), (False, True)], ids=["qwen3", "qwen2"])
@pytest.mark.parametrize("m", [1, 3, 20])
def test_norm_qkv_rope_equals_qkv_then_qk_norm_rope(m, qk_norm, bias, dtype):
    check_norm_qkv_rope(m, dtype, qk_norm, bias)


@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.usefixtures("force_triton")
def test_norm_qkv_rope_partial_rotary(m):
    """Phi-3's partial rotary: a table 3/4 of a head wide rotates those dims and keeps the rest."""
    check_norm_qkv_rope(m, torch.float32, False, True, rotary_dim=24)


# -- the USE_PDL path ------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_pdl_path_in_the_interpreter():
    """The first weight tile is loaded before gdc_wait and the loop starts one tile later; one K tile, several,
    splits, every prologue and the epilogue must still see every tile exactly once."""
    for m, config in ((1, FMA_SPLIT), (3, FMA_WHOLE_K), (16, DOT_SPLIT), (40, DOT_WHOLE_K)):
        x, w, b = make(m, 37, 64 if config.use_dot else 200, torch.float32, True, seed=m)
        check(gemv.linear(x, w, b, config=config), x, w, b)
    x, w, b = make(2, 37, 16, torch.float32, True)  # K = one tile: nothing left for the loop
    check(gemv.linear(x, w, b, config=FMA_WHOLE_K), x, w, b)
    check_norm_linear(3, torch.float32, True, FMA_SPLIT)
    check_norm_linear(20, torch.float32, True, DOT_SPLIT)


# -- GPU: real shapes, PDL, CUDA graphs ------------------------------------------------------------------
REAL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 14336),
               (960, 576), (3072, 576), (576, 1536)]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("n,k", REAL_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 32, 64])
@pytest.mark.usefixtures("force_triton")
def test_gpu_real_shapes_table_and_split_variants(m, n, k):
    """The table's variant (with PDL where the GPU has it) and a split-K variant of the other path."""
    x, w, b = make(m, n, k, torch.bfloat16, True, seed=n + m)
    check(gemv.linear(x, w, b), x, w, b)
    other = GemvConfig(8, 256, split_k=4) if gemv.choose(m, n, k, 2)[0].use_dot and m <= 16 else \
        GemvConfig(32, 256, use_dot=True, split_k=3)
    check(gemv.linear(x, w, None, config=other), x, w, None)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("m", [1, 4, 32])
@pytest.mark.usefixtures("force_triton")
def test_gpu_fused_paths_real_shapes(m, pdl):
    with switched(pdl=pdl):
        x, residual, norm_w, w, b = norm_case(m, 4096, 6144, torch.bfloat16, True)
        out, new_residual = gemv.norm_linear(x, residual, norm_w, 1e-5, w, b)
        normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-5, residual)
        check(out, normed, w, b)
        assert torch.equal(new_residual, want_residual)
        gate_up = torch.randn(m, 2 * 3072, device=DEVICE, dtype=torch.bfloat16)
        w_down = torch.randn(1024, 3072, device=DEVICE, dtype=torch.bfloat16) / 3072 ** 0.5


@pytest.mark.gpu
@needs_triton
def test_gpu_auto_rule():
    x, w, b = make(1, 4096, 1024, torch.bfloat16, True)  # 8 MiB of weight, one row
    assert gemv.kernel_applies(x, w, b) and gemv.choose(1, 4096, 1024, 2)[1]
    with torch.inference_mode():
        check(gemv.linear(x, w, b), x, w, b)
    assert not gemv.kernel_applies(torch.cat([x] * (gemv.MAX_M + 1)), w, b)  # a GEMM: cuBLAS
    assert not gemv.kernel_applies(x.float(), w.float(), None)  # fp32: cuBLAS
    assert not gemv.kernel_applies(x, w, b.float())  # F.linear would reject the mixed dtypes
    assert not gemv.kernel_applies(x[:, :1000].contiguous(), w[:, :1000].contiguous(), b)  # K % 16
    assert not gemv.kernel_applies(x, w.t().contiguous().t(), b)  # weight not contiguous
    assert not gemv.kernel_applies(x.requires_grad_(), w, b)  # grad mode and a tensor that wants grads


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("fresh_counters", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.usefixtures("force_triton")
def test_gpu_cuda_graph_replays_a_chain(fresh_counters, pdl, monkeypatch):
    """A chain of dependent products (split-K included) in one graph: each reads the previous one's output,
    which with PDL is only safe after gdc_wait. Replays reuse the persistent counters; without them at capture
    time the unsplit variant is captured."""
    if fresh_counters:
        monkeypatch.setattr(gemv, "_counters", {})
    x, w, b = make(3, 1024, 1024, torch.bfloat16, True, seed=3)
    cfgs = [GemvConfig(8, 256, split_k=4), GemvConfig(32, 256, use_dot=True, split_k=3), GemvConfig(4, 1024)]

    def chain():
        h = x
        for cfg in cfgs * 2:
            h = gemv.linear(h, w, b, config=cfg)
        return h

    def reference():
        h = x.float()
        for _ in range(6):
            h = F.linear(h.to(torch.bfloat16).float(), w.float(), b.float())
        return h

    with switched(pdl=pdl):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if not fresh_counters:
                chain()  # warm-up: compiles, creates counters
        torch.cuda.current_stream().wait_stream(stream)
        if fresh_counters:  # compile outside the capture, but leave the counters missing
            for cfg in cfgs:
                gemv.linear(x, w, b, config=GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps,
                                                                         cfg.num_stages, cfg.use_dot, split_k=1))
            monkeypatch.setattr(gemv, "_counters", {})
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for seed in (10, 11, 12):
        x.copy_(make(3, 1024, 1024, torch.bfloat16, False, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = reference()
        torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    if fresh_counters:
        assert gemv._counters == {}, "no counter buffer may be allocated from the graph's pool"
    else:
        assert int(gemv._counters[x.device].count_nonzero()) == 0
