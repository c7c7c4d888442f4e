"""FP8 weights: quantize / dequantize error bounds, the fp8 GEMV (every fused path) against a plain-PyTorch
reference on the dequantized weight, and the many-rows product (kernels/fp8.py).

CPU: the GEMV through TRITON_INTERPRET=1 (set in conftest); with CUDA the same cases compile for the GPU, and the
`gpu` tests add real decode shapes, torch._scaled_mm and CUDA-graph replay.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import attention, fp8, fused, gemv
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.gemv import GemvConfig
from nanoserve.kernels.switches import switched
from tests.kernels.test_gemv import (DEVICE, DOT_SPLIT, DOT_WHOLE_K, FMA_SPLIT, FMA_WHOLE_K, make,
                                     norm_case, tol)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
E4M3_RELATIVE = 2.0 ** -4  # half a unit in the last place of a 3-bit mantissa, relative to the value
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # e4m3's spacing below its smallest normal 2^-6, in units of the scale


def quantized(w: torch.Tensor, block: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 codes, scales per channel or per fp8.BLOCK² tile, the fp32 weight they stand for)."""
    tile = (fp8.BLOCK, fp8.BLOCK) if block else None
    q, s = fp8.quantize(w, tile)
    return q, s, fp8.dequantize(q, s, block=tile)


# -- the format ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [None, (128, 128), (1, 128), (16, 32)])
def test_round_trip_error_is_within_half_an_e4m3_step(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 520, generator=g) * torch.logspace(-3, 1, 300)[:, None]  # rows of very different range
    w[7] = 0.0  # an all-zero row
    w[11, 3] = 50.0  # an outlier
    q, scale = fp8.quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.dtype == torch.float32
    assert scale.shape == ((300,) if block is None else (-(-300 // block[0]), -(-520 // block[1])))
    back = fp8.dequantize(q, scale, block=block)
    per_value_scale = fp8.dequantize(torch.ones_like(q), scale, block=block)
    bound = torch.maximum(w.abs() * E4M3_RELATIVE, per_value_scale * E4M3_SUBNORMAL_STEP / 2) * (1 + 1e-6)
    assert torch.all((back - w).abs() <= bound)
    assert torch.isfinite(back).all() and torch.all(back[7] == 0)
    assert q.float().abs().max() == fp8.FP8_MAX  # each group's largest value maps to e4m3's largest: no saturation
    assert fp8.dequantize(q, scale, torch.bfloat16, block).dtype == torch.bfloat16


def test_gaussian_weights_lose_about_three_percent():
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1)) * 0.02
    for block in (None, (128, 128)):
        q, scale = fp8.quantize(w, block)
        rel = ((fp8.dequantize(q, scale, block=block) - w).norm() / w.norm()).item()
        assert 0.015 < rel < 0.035, (block, rel)  # 3 mantissa bits: ~2.6 % rms


def test_quantize_rows_scales_each_token():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 0.0])[:, None]
    q, scale = fp8.quantize_rows(x)
    assert scale.shape == (5, 1) and q.dtype == torch.float8_e4m3fn
    back = q.float() * scale
    assert torch.all((back - x).abs() <= x.abs() * E4M3_RELATIVE + scale * E4M3_SUBNORMAL_STEP)


def test_quantize_refuses_other_shapes():
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize(torch.randn(4, 4, 4))


# -- the many-rows product -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_dequantize_then_matmul_off_cuda(bias):
    x, w, b = make(100, 48, 64, torch.float32, bias, device="cpu")
    q, s, w_ref = quantized(w)
    assert not fp8.scaled_mm_applies(x, q, s, b)
    out = fp8.linear(x.view(4, 25, 64), q, s, b)
    assert out.shape == (4, 25, 48)
    torch.testing.assert_close(out.view(100, 48), F.linear(x, w_ref, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float8"):
        fp8.linear(x, w, s)


def test_gemv_linear_with_fp8_weight_falls_back_off_gpu():
    x, w, b = make(3, 40, 64, torch.float32, True, device="cpu")
    q, s, w_ref = quantized(w)
    assert not gemv.kernel_applies(x, q, b, s)
    torch.testing.assert_close(gemv.linear(x, q, b, weight_scale=s), F.linear(x, w_ref, b), rtol=1e-5, atol=1e-5)


def test_prefill_table():
    assert fp8.prefill_method(8192, 4096, 4096) in (fp8.SCALED_MM, fp8.DEQUANT)
    assert fp8.prefill_method(10 ** 6, 8, 16) in (fp8.SCALED_MM, fp8.DEQUANT)  # beyond the last bucket
    with pytest.raises(ValueError, match="ascend"):
        fp8._parsed_table({512: ((8, fp8.SCALED_MM),)})
    with pytest.raises(ValueError, match="methods"):
        fp8._parsed_table({512: ((None, "cublas"),)})


# -- the GEMV: plain product ---------------------------------------------------------------------------------
def check_fp8(out, x, w_ref, b, dtype):
    """Against x @ dequantized(W).T in fp32: the kernel computes the same sum (fp32), scaled once per channel."""
    want = F.linear(x.float(), w_ref, None if b is None else b.float())
    assert out.dtype == dtype and out.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,config", [(1, FMA_SPLIT), (1, FMA_WHOLE_K), (3, FMA_SPLIT), (3, DOT_SPLIT),
                                      (16, DOT_WHOLE_K), (33, DOT_SPLIT), (64, DOT_WHOLE_K)])
@pytest.mark.usefixtures("force_triton")
def test_fp8_gemv_equals_the_dequantized_product(m, config, bias, dtype):
    k = 192 if config.use_dot else 200  # odd N; for fma K not a multiple of block_k
    x, w, b = make(m, 37, k, dtype, bias, seed=m)
    q, s, w_ref = quantized(w.float())
    check_fp8(gemv.linear(x, q, b, weight_scale=s, config=config), x, w_ref, b, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,config", [(1, FMA_SPLIT), (1, FMA_WHOLE_K), (3, GemvConfig(8, 256, split_k=2)),
                                      (5, DOT_SPLIT), (20, DOT_WHOLE_K)])
@pytest.mark.usefixtures("force_triton")
def test_block_scaled_fp8_gemv_equals_the_dequantized_product(m, config, dtype):
    """Scales per 128x128 tile (block-quantized checkpoints): N and K cross tile borders, tiles of the kernel
    smaller and larger than a scale block."""
    n, k = 150, 320 if config.use_dot else 300
    x, w, b = make(m, n, k, dtype, True, seed=m)
    w = w * torch.logspace(-2, 1, k, device=w.device)  # blocks of different range: a wrong scale shows
    q, s, w_ref = quantized(w.float(), block=True)
    assert s.shape == (2, 3)
    check_fp8(gemv.linear(x, q, b, weight_scale=s, config=config), x, w_ref, b, dtype)
    out = fp8.linear(x.float().cpu(), q.cpu(), s.cpu(), b.float().cpu())  # the many-rows path: dequantize
    check_fp8(out, x.float().cpu(), w_ref.cpu(), b.float().cpu(), torch.float32)


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_fp8_table_variants():
    for m in (1, 3, 8, 40):  # the fp8 table's fma variant, then its dot variants
        x, w, b = make(m, 40, 256, torch.float32, True, seed=m)
        q, s, w_ref = quantized(w)
        cfg, triton_wins = gemv.choose(m, 40, 256, 1)
        assert triton_wins and gemv.plan(cfg, m, 40, 256, 132)
        out = gemv.linear(x, q, b, weight_scale=s)
        if cfg.act_fp8:
            check_w8a8(out, x, w_ref, b, cfg, torch.float32)
        else:
            check_fp8(out, x, w_ref, b, torch.float32)


def test_block_scaled_weights_never_take_the_dequantizing_library_path(monkeypatch):
    """Where FP8_GEMV_TABLE says cuBLAS (_scaled_mm), a weight with 128x128-block scales, which _scaled_mm's row-wise
    mode cannot take, runs the Triton kernel instead of dequantizing the weight every call."""
    cfg = GemvConfig.parse("dot8q 128x128 w4 st4 p1")
    monkeypatch.setattr(gemv, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(gemv, "choose", lambda *a: (cfg, False))
    x, w, _ = make(64, 256, 256, torch.bfloat16, False)
    q, s = fp8.quantize(w.float().cpu())
    qb, sb = fp8.quantize(w.float().cpu(), (fp8.BLOCK, fp8.BLOCK))
    monkeypatch.setattr(fp8, "scaled_mm_applies", lambda x, q, s, b: s.dim() == 1)  # as on a Hopper GPU
    assert gemv._variant(x, q, None, s, None) is None  # per channel: _scaled_mm
    assert gemv._variant(x, qb, None, sb, None) == cfg
    assert gemv._variant(x, w, None, None, None) is None  # bf16: cuBLAS


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_fp8_weight_needs_its_scale():
    x, w, _ = make(2, 16, 32, torch.float32, False)
    q, s, _ = quantized(w)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv.linear(x, q)
    with pytest.raises(ValueError, match="per-channel"):
        gemv.linear(x, q, weight_scale=s[:8])
    with pytest.raises(ValueError, match="per block"):
        fp8.dequant_linear(x, q, s[:, None])


def test_fp8_plan_counts_a_weight_byte_and_an_activation_tile():
    cfg = GemvConfig(64, 256, num_stages=4, use_dot=True)
    assert gemv.plan(cfg, 64, 4096, 4096, 132, 1, 2).num_stages == 2  # 16 KiB fp8 + 32 KiB bf16 a stage
    assert gemv.plan(cfg, 16, 4096, 4096, 132, 1, 2).num_stages == 4  # 16 + 8 KiB


# -- the GEMV: fused prologues and the epilogue ----------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,config,block", [(1, None, False), (3, FMA_SPLIT, False), (20, DOT_SPLIT, False),
                                            (1, FMA_SPLIT, True), (20, DOT_SPLIT, True)])
@pytest.mark.usefixtures("force_triton")
def test_fp8_norm_prologue(m, config, block, dtype):
    x, residual, norm_w, w, b = norm_case(m, 160 if block else 96, 40, dtype, True)
    q, s, w_ref = quantized(w.float(), block)
    out, new_residual = gemv.norm_linear(x, residual, norm_w, 1e-6, q, b, weight_scale=s,
                                         config=config)
    normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-6, residual)
    used = config or gemv.choose(m, w.shape[0], x.shape[1], 1)[0]
    if used.act_fp8:  # the table's W8A8 variant
        check_w8a8(out, normed, w_ref, b, used, dtype, exact_input=False)
    else:
        check_fp8(out, normed, w_ref, b, dtype)
    torch.testing.assert_close(new_residual, want_residual, **tol(dtype))


@needs_triton
@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_fp8_pdl_path_in_the_interpreter():
    """The first fp8 tile is loaded before gdc_wait; every path still sees each tile once and scales once."""
    for (m, config), block in itertools.product(((1, FMA_SPLIT), (16, DOT_SPLIT)), (False, True)):
        x, w, b = make(m, 37, 192 if config.use_dot else 200, torch.float32, True, seed=m)
        q, s, w_ref = quantized(w, block)
        check_fp8(gemv.linear(x, q, b, weight_scale=s, config=config), x, w_ref, b, torch.float32)


# -- W8A8: activations quantized per row and tile, the product on FP8 tensor cores ----------------------------------
def w8a8_reference(x: torch.Tensor, w_ref: torch.Tensor, b, group: int) -> torch.Tensor:
    """x quantized as the kernel does (fp8.quantize_groups: per row and `group` columns) times the fp32 weight, on the
    CPU: torch on CUDA divides by a scalar as a multiply by its reciprocal, so its scales can differ from the kernels'
    IEEE quotient in the last bit and flip codes."""
    xq, x_scale = fp8.quantize_groups(x.float().cpu(), group)
    return F.linear(fp8.dequantize_groups(xq, x_scale, group), w_ref.cpu(), None if b is None else b.float().cpu())


def check_w8a8(out, x, w_ref, b, config, dtype, exact_input=True):
    """Against w8a8_reference in fp32: in the interpreter the same products summed in another order, rounded once to
    dtype. On the GPU the FP8 tensor cores accumulate with fewer bits than fp32: the H200's results differ from the
    reference by up to ~2.5e-4 of the largest output (cuBLAS's FP8 product of the same codes alike; our kernel with
    its products in fp32 by as much as with them on tensor cores: benchmarks/w8a8_accuracy.py,
    results/experiments/w8a8_accuracy_h200.json).
    Where x comes from a GPU producer (norm, SiLU-mul) whose last bit may differ from its reference, one e4m3 code of
    a large x can flip (a 6 % step of that value), so there the bound is on the whole product's error."""
    want = w8a8_reference(x, w_ref, b, fp8.BLOCK)
    assert out.dtype == dtype and out.shape == want.shape
    scale, on_gpu, out = want.abs().max().item(), out.is_cuda, out.cpu()
    if on_gpu and not exact_input:
        err = (out.float() - want).norm() / want.norm()
        assert err < 1e-2 and (out.float() - want).abs().max() < 0.05 * scale, err
    elif on_gpu:
        torch.testing.assert_close(out.float(), want, rtol=1e-5 if dtype == torch.float32 else 2 ** -8,
                                   atol=5e-4 * scale)
    else:
        atol = (1e-5 if dtype == torch.float32 else 1e-2) * scale
        torch.testing.assert_close(out.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=atol)
    # W8A16 on the same weight: near, not equal
    plain = F.linear(x.float().cpu(), w_ref.cpu(), None if b is None else b.float().cpu())
    assert 0 < (want - plain).abs().max() < 0.05 * plain.abs().max()


DOT8Q_SPLIT = GemvConfig.parse("dot8q 16x32 w4 st2 s3")  # x quantized before: a scale per 128 columns, 4 tiles
DOT8Q_WHOLE_K = GemvConfig.parse("dot8q 64x128 w4 st3 p0")


def _exact(dtype):
    """The quantizing kernels equal their reference bit for bit (fp32 inputs in the interpreter, whose fp32 → bf16
    cast is not torch's; any dtype on the GPU)."""
    return DEVICE == "cuda" or dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("m,config", [(1, DOT8Q_SPLIT), (5, DOT8Q_WHOLE_K), (33, DOT8Q_SPLIT), (64, DOT8Q_WHOLE_K)])
@pytest.mark.usefixtures("force_triton")
def test_w8a8_on_prequantized_rows(m, config, block, dtype):
    """dot8q: linear quantizes x in a kernel of its own, norm_linear in the norm, silu_mul_linear in the act-mul
    (SiLU and tanh-GELU);
    each product equals the W8A8 reference on the rows its producer's reference gives."""
    n, k = (150, 320) if block else (37, 200)
    x, w, b = make(m, n, k, dtype, True, seed=m)
    x = x * torch.logspace(-2, 1, k, device=x.device).to(dtype)
    q, s, w_ref = quantized(w.float(), block)
    check_w8a8(gemv.linear(x, q, b, weight_scale=s, config=config), x, w_ref, b, config, dtype)
    gate_up = torch.cat([x, x.flip(1)], dim=1)
    for activation in fused.ACTIVATIONS:
        out = gemv.silu_mul_linear(gate_up, q, b, weight_scale=s, config=config, activation=activation)
        check_w8a8(out, fused.silu_and_mul_ref(gate_up, activation), w_ref, b, config, dtype, exact_input=False)
    if _exact(dtype):
        residual, norm_w = x.flip(0), torch.linspace(0.5, 2, k, device=x.device).to(dtype)
        out, new_residual = gemv.norm_linear(x, residual, norm_w, 1e-6, q, b, weight_scale=s,
                                             config=config)
        normed, want_residual = fused.rms_norm_ref(x, norm_w, 1e-6, residual)
        check_w8a8(out, normed, w_ref, b, config, dtype, exact_input=False)
        assert torch.equal(new_residual, want_residual)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("k", [96, 200, 1536, 3000])
@pytest.mark.usefixtures("force_triton")
def test_quantizing_kernels_equal_their_references(k, dtype):
    """rms_norm / silu_and_mul (both activations) with quantize=True and quantize_activations: fp8.groups_ref of the
    same kernel's unquantized output (itself tested against its reference), codes and scales bit for bit in the
    interpreter."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(3, k, generator=g) * torch.logspace(-3, 1, k)).to(DEVICE, dtype)
    norm_w = torch.randn(k, generator=g).to(DEVICE, dtype)
    gate_up = torch.cat([x, x.flip(1)], 1)
    results = [(fused.rms_norm(x, norm_w, 1e-6, quantize=True),
                fused.rms_norm(x, norm_w, 1e-6)),
               (fused.rms_norm(x, norm_w, 1e-6, x.flip(0), quantize=True)[0],
                fused.rms_norm(x, norm_w, 1e-6, x.flip(0))[0]),
               (fused.silu_and_mul(gate_up, quantize=True), fused.silu_and_mul(gate_up)),
               (fused.silu_and_mul(gate_up, quantize=True, activation="gelu_tanh"),
                fused.silu_and_mul(gate_up, activation="gelu_tanh")),
               (fp8.quantize_activations(x), x)]
    for rows, plain in results:
        want = fp8.groups_ref(plain.cpu())
        assert rows.codes.dtype == fp8.FP8_DTYPE and rows.scales.shape == (3, -(-k // 128)) and rows.dtype == dtype
        if DEVICE == "cuda":  # two compiled kernels may round an fp32 sum differently in the last bit
            torch.testing.assert_close(rows.scales.cpu(), want.scales, rtol=1e-6, atol=0)
            assert (rows.codes.cpu().float() == want.codes.float()).float().mean() >= 0.999
        else:
            assert torch.equal(rows.scales.cpu(), want.scales)
            assert torch.equal(rows.codes.cpu().float(), want.codes.float())


@needs_triton
@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_w8a8_pdl_path_in_the_interpreter():
    """The first fp8 weight tile is loaded before gdc_wait, the codes and their scales after it."""
    for block in (False, True):
        x, w, b = make(7, 130, 256, torch.float32, True, seed=7)
        q, s, w_ref = quantized(w, block)
        check_w8a8(gemv.linear(x, q, b, weight_scale=s, config=DOT8Q_SPLIT), x, w_ref, b,
                   DOT8Q_SPLIT, torch.float32)


def test_w8a8_configs_are_dot_paths_within_one_scale_block():
    assert DOT8Q_WHOLE_K.act_fp8 and DOT8Q_WHOLE_K.use_dot and GemvConfig.parse(DOT8Q_WHOLE_K.short()) == DOT8Q_WHOLE_K
    for bad in ("dot8q 64x256 w4 st3 p0", "dot8q 64x16 w4 st3 p0", "dot8 64x128 w4 st3 p0"):
        with pytest.raises(ValueError, match="bad GEMV config"):
            GemvConfig.parse(bad)
    with pytest.raises(ValueError, match="act_fp8"):
        GemvConfig(8, 128, act_fp8=True)  # not a tl.dot path
    assert gemv.plan(DOT8Q_WHOLE_K, 64, 4096, 4096, 132, 1, 2).num_stages == 3  # 8 KiB of weights + 8 KiB of x
    assert gemv.plan(DOT8Q_WHOLE_K, 5, 64, 48, 132, 1, 2).block_k == 64  # never below 32, never above K's power of 2


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_w8a8_needs_an_fp8_weight():
    x, w, _ = make(4, 16, 64, torch.bfloat16, False)
    with pytest.raises(ValueError, match="W8A8"):
        gemv.linear(x, w, config=DOT8Q_SPLIT)


@needs_triton
@pytest.mark.usefixtures("force_triton")
def test_interpreter_e4m3_rounding_and_the_row_quantize_kernel():
    """fp8.e4m3_rounded (the interpreter's stand-in for the GPU's fp32 → e4m3 cast) rounds like torch; the Triton
    quantize_rows equals its reference (one scale per token)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3000, generator=g) * torch.logspace(-4, 2, 6)[:, None]
    x[2] = 0.0
    x[4, :8] = torch.tensor([127.9, 15.5, -9.5, 8.5, 2.0 ** -9 * 1.5, 2.0 ** -9 * 2.5, 240.0, -300.0])
    for xb in (x, x.to(torch.bfloat16)):
        q, scale = fp8.quantize_rows(xb.to(DEVICE))
        q_ref, scale_ref = fp8.quantize_rows_ref(xb)
        assert q.dtype == fp8.FP8_DTYPE and scale.shape == (6, 1)
        torch.testing.assert_close(scale.cpu(), scale_ref, rtol=0, atol=0)
        assert torch.equal(q.cpu().float(), q_ref.float())


# -- GPU: real shapes, _scaled_mm, CUDA graphs -------------------------------------------------------------------
REAL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 14336),
               (960, 576), (3072, 576), (576, 1536)]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("n,k", REAL_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 32, 64])
def test_gpu_fp8_real_shapes_table_variant(m, n, k):
    x, w, b = make(m, n, k, torch.bfloat16, True, seed=n + m)
    q, s, w_ref = quantized(w)
    assert gemv.kernel_applies(x, q, b, s)
    config, _ = gemv.choose(m, n, k, 1)
    with torch.inference_mode():
        out = gemv.linear(x, q, b, weight_scale=s)  # the table decides
    if config.act_fp8:
        check_w8a8(out, x, w_ref, b, config, torch.bfloat16)
    else:
        check_fp8(out, x, w_ref, b, torch.bfloat16)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("m", [1, 4, 32])
@pytest.mark.usefixtures("force_triton")
def test_gpu_fp8_fused_paths(m, pdl, block):
    with switched(pdl=pdl):
        test_fp8_norm_prologue(m, None, block, torch.bfloat16)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("m", [65, 512, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_scaled_mm_and_dequant_agree_with_the_reference(m, bias):
    x, w, b = make(m, 1024, 2048, torch.bfloat16, bias, seed=m)
    q, s, w_ref = quantized(w)
    assert fp8.scaled_mm_applies(x, q, s, b) == (torch.cuda.get_device_capability() >= (8, 9))
    want = F.linear(x.float(), w_ref, None if b is None else b.float())
    for method in (fp8.DEQUANT, fp8.SCALED_MM) if fp8.scaled_mm_applies(x, q, s, b) else (fp8.DEQUANT,):
        out = fp8.linear(x, q, s, b, method=method)
        # _scaled_mm also quantizes x per token: one more e4m3 rounding, ~2.6 % of each product, averaging out
        # over K = 2048 to ~0.1 % of the largest output
        rel = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert rel < (3e-2 if method == fp8.SCALED_MM else 1e-2), (method, rel)
    torch.testing.assert_close(gemv.linear(x, q, b, weight_scale=s).float(), want, rtol=3e-2,
                               atol=3e-2 * want.abs().max().item())


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.usefixtures("force_triton")
def test_gpu_fp8_cuda_graph_replays_a_chain(pdl):
    """fp8 products (split-K included) chained in one graph, replayed with new inputs."""
    x, w, b = make(3, 1024, 1024, torch.bfloat16, True, seed=3)
    q, s, w_ref = quantized(w)
    cfgs = [GemvConfig(8, 512, split_k=4), GemvConfig(32, 256, use_dot=True, split_k=3), GemvConfig(4, 2048)]

    def chain():
        h = x
        for cfg in cfgs * 2:
            h = gemv.linear(h, q, b, weight_scale=s, config=cfg)
        return h

    def reference():
        h = x.float()
        for _ in range(6):
            h = F.linear(h.to(torch.bfloat16).float(), w_ref, b.float())
        return h

    with switched(pdl=pdl):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()  # warm-up: compiles, creates the split-K counters
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for seed in (10, 11):
        x.copy_(make(3, 1024, 1024, torch.bfloat16, False, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = reference()
        torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
