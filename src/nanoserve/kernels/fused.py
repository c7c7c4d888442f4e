"""Fused elementwise kernels: (owed post-norm +) residual add + RMSNorm, act-and-mul of a gated MLP (SiLU or
tanh-GELU; Triton on CUDA, plain PyTorch elsewhere).

A decode step is a few hundred small kernels, so every launch counts even inside a CUDA graph
(each costs a couple of microseconds of GPU time). These fuse what eager PyTorch runs as several
kernels. Each function has the same contract on both paths; the `_ref` functions are the plain-PyTorch
references the tests check the Triton kernels against (on CPU through TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import fp8
from nanoserve.kernels._triton import cdiv, jit, next_power_of_2, pdl_args, pdl_start, pdl_wait, tl, use_triton


# -- residual add + RMSNorm --------------------------------------------------------------------
def rms_norm_ref(x, weight, eps, residual=None, x_norm=None):
    """HF semantics: normalise in float32, round to the input dtype, then scale by the weight. x_norm = (weight, eps)
    of a norm still owed to x (Gemma's post-norm) is applied first, as its own call would be."""
    if x_norm is not None:
        x = rms_norm_ref(x, *x_norm)
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed, residual) if residual is not None else weight * normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False, x_norm: tuple[torch.Tensor, float] | None = None):
    """rms_norm(x) or, given a residual, (rms_norm(x + residual), x + residual). x is [T, N]. With quantize the
    normed rows come as fp8.Fp8Rows (for a W8A8 product), quantized by the same kernel. x_norm = (weight, eps): a
    norm still owed to x (Gemma's post-norm), applied to x first in the same kernel; the result is bit for bit that
    of the two calls rms_norm(x, *x_norm), then this one (the post-norm's output rounded to x's dtype as stored)."""
    if not use_triton(x):
        out = rms_norm_ref(x, weight, eps, residual, x_norm)
        if not quantize:
            return out
        return (fp8.groups_ref(out[0]), out[1]) if residual is not None else fp8.groups_ref(out)
    rows, n = x.shape
    out = fp8.empty_rows(rows, n, x.dtype, x.device) if quantize else torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    codes, scales = (out.codes, out.scales) if quantize else (out, x)  # x: a placeholder, never written
    post_weight, post_eps = x_norm if x_norm is not None else (weight, 0.0)  # weight: a placeholder, never read
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, post_weight, codes, scales,
                              new_residual, x.stride(0), (residual if residual is not None else x).stride(0), n, eps,
                              post_eps, HAS_RESIDUAL=residual is not None, POST_NORM=x_norm is not None,
                              BLOCK=max(fp8.BLOCK, next_power_of_2(n)), QUANTIZE=quantize, EXACT_CAST=not x.is_cuda,
                              enable_fp_fusion=x_norm is None, **pdl_args(x.device))
    return (out, new_residual) if residual is not None else out


# -- act(gate) * up ----------------------------------------------------------------------------------
# The gated MLP's activations: "silu" (SwiGLU: Llama, Qwen, Mistral, Phi-3) and "gelu_tanh" (GeGLU: Gemma's
# gelu_pytorch_tanh, torch's F.gelu(approximate="tanh")).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # name → the kernels' ACTIVATION constexpr


def activation_id(activation: str) -> int:
    """The kernels' code for an activation name; ValueError for one no kernel implements."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported MLP activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


def silu_and_mul_ref(x, activation: str = "silu"):
    """act(gate) * up in x's dtype, as HF's gated MLPs compute it (the activation in fp32 inside torch)."""
    activation_id(activation)
    gate, up = x.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def silu_and_mul(x: torch.Tensor, quantize: bool = False, activation: str = "silu"):
    """[T, 2I] holding [gate, up] → act(gate) * up, [T, I] (act: an ACTIVATIONS name); with quantize as fp8.Fp8Rows
    (for a W8A8 product)."""
    act = activation_id(activation)
    if not use_triton(x):
        out = silu_and_mul_ref(x, activation)
        return fp8.groups_ref(out) if quantize else out
    rows, width = x.shape
    half = width // 2
    out = fp8.empty_rows(rows, half, x.dtype, x.device) if quantize else torch.empty(rows, half, dtype=x.dtype,
                                                                                       device=x.device)
    codes, scales = (out.codes, out.scales) if quantize else (out, x)
    block = max(fp8.BLOCK, min(next_power_of_2(half), 1024))
    _silu_and_mul_kernel[(rows, cdiv(half, block))](x, codes, scales, x.stride(0), half, BLOCK=block,
                                                    QUANTIZE=quantize, ACTIVATION=act, EXACT_CAST=not x.is_cuda,
                                                    **pdl_args(x.device))
    return out


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, post_w_ptr, out_ptr, scale_ptr, res_out_ptr, stride_x, stride_r, n, eps,
                     post_eps, HAS_RESIDUAL: tl.constexpr, POST_NORM: tl.constexpr, BLOCK: tl.constexpr,
                     QUANTIZE: tl.constexpr, EXACT_CAST: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    pdl_start(USE_PDL)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # weights: safe before the wait
    if POST_NORM:
        post_w = tl.load(post_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if POST_NORM:  # the owed norm, rounded as its own kernel would store it. (Launched without FP fusion: the compiler
        # would fuse its last product with the residual add into one FMA, skipping that rounding; measured on the H200.)
        post_inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + post_eps)
        xf = (post_w * (xf * post_inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:  # the sum is rounded to the model dtype, like HF's add
        xf = (xf + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * n + cols, xf, mask=mask)
        xf = xf.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv_rms).to(dtype).to(tl.float32)
    if QUANTIZE:  # the values the bf16 path would store, quantized per 128 columns
        fp8.store_groups((w * normed).to(dtype).to(tl.float32), out_ptr, scale_ptr, row, 0, n, BLOCK,
                         fp8.SCALE_GROUP_K, EXACT_CAST)
    else:
        tl.store(out_ptr + row * n + cols, (w * normed).to(dtype), mask=mask)


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, stride_x, half, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
                         ACTIVATION: tl.constexpr, EXACT_CAST: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + half + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 1:  # tanh-GELU: 0.5·g·(1 + tanh(z)) = g · sigmoid(2z), z = sqrt(2/π)·(g + 0.044715·g³);
        # 1.5957691216057308 = 2·sqrt(2/π)
        act = gate / (1.0 + tl.exp(-1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)))
    else:  # SiLU
        act = gate / (1.0 + tl.exp(-gate))
    out = (act * up).to(x_ptr.dtype.element_ty)
    if QUANTIZE:
        fp8.store_groups(out.to(tl.float32), out_ptr, scale_ptr, row, tl.program_id(1) * BLOCK, half, BLOCK,
                         fp8.SCALE_GROUP_K, EXACT_CAST)
    else:
        tl.store(out_ptr + row * half + cols, out, mask=mask)
