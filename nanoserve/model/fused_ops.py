"""Fused elementwise kernels for the decode path (Triton on CUDA, plain PyTorch elsewhere).

A decode step is a few hundred small kernels, so every launch counts even inside a CUDA graph
(each costs a couple of microseconds of GPU time). These fuse what eager PyTorch runs as several
kernels: residual add + RMSNorm, SiLU-and-mul, and per-head q/k RMSNorm + rotary embedding.
Each function has the same contract on both paths; tests check the Triton one against the
PyTorch one (on CPU through TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.attention import torch_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# -- residual add + RMSNorm --------------------------------------------------------------------
def rms_norm_ref(x, weight, eps, residual=None):
    """HF semantics: normalise in float32, round to the input dtype, then scale by the weight."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed, residual) if residual is not None else weight * normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             force_triton: bool = False):
    """rms_norm(x) or, given a residual, (rms_norm(x + residual), x + residual). x is [T, N]."""
    if not (force_triton or use_triton(x)):
        return rms_norm_ref(x, weight, eps, residual)
    rows, n = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, new_residual,
                              x.stride(0), (residual if residual is not None else x).stride(0), n, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return (out, new_residual) if residual is not None else out


# -- SiLU and mul --------------------------------------------------------------------------------
def silu_and_mul_ref(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, force_triton: bool = False) -> torch.Tensor:
    """[T, 2I] holding [gate, up] → silu(gate) * up, [T, I]."""
    if not (force_triton or use_triton(x)):
        return silu_and_mul_ref(x)
    rows, width = x.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(half), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(half, block))](x, out, x.stride(0), half, BLOCK=block)
    return out


# -- per-head q/k RMSNorm + rotary ---------------------------------------------------------------
def qk_norm_rope_ref(q, k, cos_sin_cache, positions, q_norm_w=None, k_norm_w=None, eps=1e-6, kv_store=None):
    """q [T, H, D], k [T, Hkv, D] → rotated (and first per-head normalised, Qwen3) q, k.

    cos_sin_cache rows are [cos, cos, -sin, sin] (each D/2), neox rotate-half as in HF Llama/Qwen.
    kv_store = (v, k_cache, v_cache, slot_mapping): also write the rotated k and v into the paged cache.
    """
    d = q.shape[-1]
    cs = F.embedding(positions, cos_sin_cache).unsqueeze(1)
    cos, sin = cs[..., :d], cs[..., d:]
    out = []
    for x, w in ((q, q_norm_w), (k, k_norm_w)):
        if w is not None:
            x = rms_norm_ref(x, w, eps)
        x1, x2 = x.chunk(2, dim=-1)
        out.append(torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin))
    if kv_store is not None:
        v, k_cache, v_cache, slot_mapping = kv_store
        torch_ref.store_kv(out[1], v, k_cache, v_cache, slot_mapping)
    return out[0], out[1]


def qk_norm_rope(q, k, cos_sin_cache, positions, q_norm_w=None, k_norm_w=None, eps=1e-6, kv_store=None,
                 force_triton=False):
    """One kernel for all q and k heads (and the KV-cache store); q/k/v may be strided views of the qkv output."""
    if not (force_triton or use_triton(q)) or q.shape[-1] & (q.shape[-1] - 1):  # kernel needs a power-of-2 head_dim
        return qk_norm_rope_ref(q, k, cos_sin_cache, positions, q_norm_w, k_norm_w, eps, kv_store)
    tokens, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(tokens, num_heads, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_kv_heads, d, dtype=k.dtype, device=k.device)
    has_norm = q_norm_w is not None
    v, k_cache, v_cache, slots = kv_store if kv_store is not None else (k, k_out, k_out, positions)
    if kv_store is not None and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")
    _qk_norm_rope_kernel[(tokens, num_heads + num_kv_heads)](
        q, k, v, q_out, k_out, k_cache, v_cache, slots, cos_sin_cache, positions,
        q_norm_w if has_norm else cos_sin_cache, k_norm_w if has_norm else cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), num_heads, eps,
        HEAD_DIM=d, HAS_NORM=has_norm, STORE_KV=kv_store is not None)
    return q_out, k_out


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        dtype = out_ptr.dtype.element_ty
        xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # the sum is rounded to the model dtype, like HF's add
            xf = (xf + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row * n + cols, xf, mask=mask)
            xf = xf.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (xf * inv_rms).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (w * normed).to(dtype), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, half, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + half + cols, mask=mask, other=0.0).to(tl.float32)
        silu = gate / (1.0 + tl.exp(-gate))
        tl.store(out_ptr + row * half + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                             cos_sin_ptr, pos_ptr, qw_ptr, kw_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_heads, eps,
                             HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        is_q = head < num_heads
        kv_head = head - num_heads
        half: tl.constexpr = HEAD_DIM // 2
        dims = tl.arange(0, HEAD_DIM)
        partner = (dims + half) % HEAD_DIM
        if is_q:
            src = q_ptr + token * stride_qt + head * stride_qh
            dst = q_out_ptr + (token * num_heads + head) * HEAD_DIM
            w_ptr = qw_ptr
        else:
            src = k_ptr + token * stride_kt + kv_head * stride_kh
            dst = k_out_ptr + (token * (tl.num_programs(1) - num_heads) + kv_head) * HEAD_DIM
            w_ptr = kw_ptr
        dtype = q_out_ptr.dtype.element_ty
        x = tl.load(src + dims).to(tl.float32)
        x_partner = tl.load(src + partner).to(tl.float32)
        if HAS_NORM:  # HF: normalise in float32, round, then scale by the (model-dtype) weight and round
            inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
            x = (tl.load(w_ptr + dims).to(tl.float32) * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype)
            x_partner = tl.load(w_ptr + partner).to(tl.float32) * (x_partner * inv_rms).to(dtype).to(tl.float32)
            x, x_partner = x.to(tl.float32), x_partner.to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * 2 * HEAD_DIM + dims).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * 2 * HEAD_DIM + HEAD_DIM + dims).to(tl.float32)
        out = (x * cos + x_partner * sin).to(dtype)
        tl.store(dst + dims, out)
        if STORE_KV:
            if kv_head >= 0:  # write this token's rotated k and its v into the paged cache
                num_kv_heads = tl.num_programs(1) - num_heads
                slot = tl.load(slot_ptr + token).to(tl.int64)
                cache_at = (slot * num_kv_heads + kv_head) * HEAD_DIM + dims
                tl.store(k_cache_ptr + cache_at, out)
                v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + dims)
                tl.store(v_cache_ptr + cache_at, v)
