"""Per-head q/k RMSNorm + rotary embedding + KV-cache store: one kernel for all heads of a step, after the qkv
GEMV (gemv.norm_qkv_rope).

qk_norm_rope_ref is the plain-PyTorch reference (HF semantics) it is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels import kv_quant, reference
from nanoserve.kernels._triton import cdiv, jit, pdl_args, pdl_start, pdl_wait, tl, use_triton
from nanoserve.kernels.fused import rms_norm_ref
from nanoserve.kernels.kv_quant import quantize_rows
from nanoserve.kernels.paging import require_cache_layout


@dataclass
class QKVRope:
    """What the rotary + KV-store step of one attention layer needs besides the qkv values."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos_sin_cache: torch.Tensor  # [max_position, 2 * rotary_dim]: rows [cos, cos, -sin, sin] (see rotary_dim)
    positions: torch.Tensor  # [T]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    q_norm_weight: torch.Tensor | None = None  # per-head RMSNorm of q and k (Qwen3)
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # an fp8 cache's (kernels/kv_quant.py)
    kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None  # an fp8 cache's tail, and each token's row in it
    tail_rows: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """Columns of the qkv product: q heads, then k heads, then v heads."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k / v [T, Hkv, D]: views of the qkv product [T, width]."""
        d, q_size, kv_size = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        t = qkv.shape[0]
        return q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The separate kernel: (q, k) normalised and rotated; k and v stored in the cache."""
        return qk_norm_rope(q, k, self.cos_sin_cache, self.positions, self.q_norm_weight, self.k_norm_weight,
                            self.eps, kv_store=self.kv_store(v))

    def kv_store(self, v: torch.Tensor) -> tuple:
        """qk_norm_rope's kv_store for these v."""
        return v, self.k_cache, self.v_cache, self.slot_mapping, self.kv_scales, self.kv_tail, self.tail_rows


def _cache_strides(cache: torch.Tensor) -> tuple[int, ...]:
    """A cache's (block, offset, kv head, dim) strides; without a KV store (k_out stands in), unused zeros."""
    return cache.stride() if cache.dim() == 4 else (0, 0, 0, 0)


def rotary_dim(cos_sin_cache: torch.Tensor, head_dim: int) -> int:
    """The dims each head rotates, read from the table's width: rows are [cos, cos, -sin, sin] of rotary_dim / 2
    each, so a partial-rotary model (Phi-3 / Phi-4-mini's partial_rotary_factor) needs no argument of its own. The
    first rotary_dim dims of a head are rotated (neox rotate-half among them), the rest pass through unchanged."""
    dims = cos_sin_cache.shape[-1] // 2
    if cos_sin_cache.shape[-1] % 4 or not 0 < dims <= head_dim:
        raise ValueError(f"a cos/sin table of width {cos_sin_cache.shape[-1]} does not fit head_dim {head_dim}: "
                         f"expected 2 * rotary_dim with rotary_dim even and at most head_dim")
    return dims


def qk_norm_rope_ref(q, k, cos_sin_cache, positions, q_norm_w=None, k_norm_w=None, eps=1e-6, kv_store=None):
    """q [T, H, D], k [T, Hkv, D] → rotated (and first per-head normalised, Qwen3) q, k.

    cos_sin_cache rows are [cos, cos, -sin, sin] (each rotary_dim / 2), neox rotate-half as in HF Llama/Qwen over the
    first rotary_dim dims of each head (HF Phi-3's partial rotary), the rest unrotated.
    kv_store = (v, k_cache, v_cache, slot_mapping, kv_scales[, kv_tail, tail_rows]): also write the rotated k and v
    into the paged cache (kv_scales: an fp8 cache's, else None; kv_tail: its tail, written at tail_rows >= 0).
    """
    rd = rotary_dim(cos_sin_cache, q.shape[-1])
    cs = F.embedding(positions, cos_sin_cache).unsqueeze(1)
    cos, sin = cs[..., :rd], cs[..., rd:]
    out = []
    for x, w in ((q, q_norm_w), (k, k_norm_w)):
        if w is not None:
            x = rms_norm_ref(x, w, eps)
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        out.append(torch.cat((torch.addcmul(x_rot * cos, torch.cat((x2, x1), dim=-1), sin), x_pass), dim=-1))
    if kv_store is not None:
        v, k_cache, v_cache, slot_mapping, kv_scales, kv_tail, tail_rows = (*kv_store, None, None)[:7]
        reference.store_kv(out[1], v, k_cache, v_cache, slot_mapping, kv_scales, kv_tail, tail_rows)
    return out[0], out[1]


# Tokens per program: one head of one token is only HEAD_DIM values, so at prefill sizes a program per
# (token, head) is many times slower than the bytes need (measured: notes/PERF.md, issue 34 figures,
# rotary_kv.ROPE_BLOCK_T).
ROPE_BLOCK_T = 16
ROPE_MIN_TOKENS_PER_BLOCK = 256  # below this many tokens, one token per program keeps the grid wide (decode)
# Up to this many tokens each (token, head) program is one warp: its head_dim values are 4 a lane, and the launch is
# latency, not bandwidth. H100, µs a layer of Qwen3-0.6B's heads (benchmarks/kv_store.py; 4 warps → 1): fp8 cache
# b = 1 3.13 → 2.87, b = 64 4.28 → 3.82; bf16 2.73 → 2.22, 3.44 → 2.96; at b = 256 one warp loses (12.8 → 19.2, bf16
# 5.04 → 5.81: 32 programs a SM then hold only 32 warps).
ROPE_ONE_WARP_TOKENS = 64


def qk_norm_rope(q, k, cos_sin_cache, positions, q_norm_w=None, k_norm_w=None, eps=1e-6, kv_store=None):
    """One kernel for all q and k heads (and the KV-cache store); q/k/v may be strided views of the qkv output."""
    if not use_triton(q) or q.shape[-1] & (q.shape[-1] - 1):  # kernel needs a power-of-2 head_dim
        return qk_norm_rope_ref(q, k, cos_sin_cache, positions, q_norm_w, k_norm_w, eps, kv_store)
    tokens, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    rd = rotary_dim(cos_sin_cache, d)
    q_out = torch.empty(tokens, num_heads, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_kv_heads, d, dtype=k.dtype, device=k.device)
    has_norm = q_norm_w is not None
    v, k_cache, v_cache, slots, kv_scales, kv_tail, tail_rows = (*kv_store, None, None)[:7] \
        if kv_store is not None else (k, k_out, k_out, positions, None, None, None)
    k_tail, v_tail = kv_tail if kv_tail is not None else (k_out, k_out)
    scales, fmt = kv_quant.kernel_args(k_cache, kv_scales)
    if kv_store is not None:
        require_cache_layout("qk_norm_rope", k_cache, v_cache, kv_scales if fmt["TOKEN_SCALES"] else None)
    if not cos_sin_cache.is_contiguous():
        raise ValueError("the cos/sin table must be contiguous [max_position, 2 * rotary_dim]")
    block_t = ROPE_BLOCK_T if tokens >= ROPE_MIN_TOKENS_PER_BLOCK else 1
    _qk_norm_rope_kernel[(cdiv(tokens, block_t), num_heads + num_kv_heads)](
        q, k, v, q_out, k_out, k_cache, v_cache, slots, k_tail, v_tail, tail_rows if kv_tail is not None else slots,
        cos_sin_cache, positions,
        q_norm_w if has_norm else cos_sin_cache, k_norm_w if has_norm else cos_sin_cache, scales[0], scales[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), tokens, num_heads,
        num_kv_heads, eps, scales[3], scales[4], *_cache_strides(k_cache), *_cache_strides(v_cache),
        BLOCK_SIZE=k_cache.shape[1] if kv_store is not None else 1, HEAD_DIM=d, ROTARY_DIM=rd, BLOCK_T=block_t,
        HAS_NORM=has_norm,
        STORE_KV=kv_store is not None, TAIL=kv_tail is not None, **fmt,
        num_warps=1 if tokens <= ROPE_ONE_WARP_TOKENS else 4, **pdl_args(q.device))
    return q_out, k_out


@jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         k_tail_ptr, v_tail_ptr, tail_row_ptr, cos_sin_ptr, pos_ptr, qw_ptr, kw_ptr, ks_ptr, vs_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_tokens, num_heads,
                         num_kv_heads, eps, stride_s_slot, stride_s_h, stride_kc_b, stride_kc_t, stride_kc_h,
                         stride_kc_d, stride_vc_b, stride_vc_t, stride_vc_h, stride_vc_d, BLOCK_SIZE: tl.constexpr,
                         HEAD_DIM: tl.constexpr,
                         ROTARY_DIM: tl.constexpr, BLOCK_T: tl.constexpr, HAS_NORM: tl.constexpr,
                         STORE_KV: tl.constexpr, TAIL: tl.constexpr, FP8: tl.constexpr, TOKEN_SCALES: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)  # everything below reads the previous kernels' outputs
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]  # [BLOCK_T, 1]
    token_ok = tokens < num_tokens
    head = tl.program_id(1)
    is_q = head < num_heads
    kv_head = head - num_heads
    half: tl.constexpr = ROTARY_DIM // 2
    dims = tl.arange(0, HEAD_DIM)[None, :]
    if ROTARY_DIM == HEAD_DIM:
        partner = (dims + half) % HEAD_DIM
    else:  # partial rotary: the dims past ROTARY_DIM are their own partner, with cos 1 and sin 0 (kept as they are)
        partner = tl.where(dims < ROTARY_DIM, (dims + half) % ROTARY_DIM, dims)
    if is_q:
        src = q_ptr + tokens * stride_qt + head * stride_qh
        dst = q_out_ptr + (tokens * num_heads + head) * HEAD_DIM
        w_ptr = qw_ptr
    else:
        src = k_ptr + tokens * stride_kt + kv_head * stride_kh
        dst = k_out_ptr + (tokens * num_kv_heads + kv_head) * HEAD_DIM
        w_ptr = kw_ptr
    dtype = q_out_ptr.dtype.element_ty
    x = tl.load(src + dims, mask=token_ok, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner, mask=token_ok, other=0.0).to(tl.float32)
    if HAS_NORM:  # HF: normalise in float32, round, then scale by the (model-dtype) weight and round
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = (tl.load(w_ptr + dims).to(tl.float32) * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype)
        x_partner = tl.load(w_ptr + partner).to(tl.float32) * (x_partner * inv_rms).to(dtype).to(tl.float32)
        x, x_partner = x.to(tl.float32), x_partner.to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    if ROTARY_DIM == HEAD_DIM:
        cos = tl.load(cos_sin_ptr + pos * 2 * ROTARY_DIM + dims).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * 2 * ROTARY_DIM + ROTARY_DIM + dims).to(tl.float32)
    else:
        rotated = dims < ROTARY_DIM
        cos = tl.load(cos_sin_ptr + pos * 2 * ROTARY_DIM + dims, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * 2 * ROTARY_DIM + ROTARY_DIM + dims, mask=rotated, other=0.0).to(tl.float32)
    out = (x * cos + x_partner * sin).to(dtype)
    tl.store(dst + dims, out, mask=token_ok)
    if STORE_KV:
        if kv_head >= 0:  # write these tokens' rotated k and their v into the paged cache
            slot = tl.load(slot_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE  # (an fp8 cache's V is transposed in its blocks)
            v = tl.load(v_ptr + tokens * stride_vt + kv_head * stride_vh + dims, mask=token_ok)
            k = out
            if TAIL:  # the token's K/V in the model's dtype too, where its tail row says (kernels/kv_quant.py)
                row = tl.load(tail_row_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
                tail_at = (row * num_kv_heads + kv_head) * HEAD_DIM + dims
                tl.store(k_tail_ptr + tail_at, k.to(k_tail_ptr.dtype.element_ty), mask=token_ok & (row >= 0))
                tl.store(v_tail_ptr + tail_at, v.to(v_tail_ptr.dtype.element_ty), mask=token_ok & (row >= 0))
            if FP8:  # e4m3 codes of the rounded k and of v, and their scales (kernels/kv_quant.py)
                scale_at = slot * stride_s_slot + kv_head * stride_s_h
                k = quantize_rows(k, ks_ptr + scale_at, token_ok, TOKEN_SCALES)
                v = quantize_rows(v, vs_ptr + scale_at, token_ok, TOKEN_SCALES)
            tl.store(k_cache_ptr + block * stride_kc_b + offset * stride_kc_t + kv_head * stride_kc_h
                     + dims * stride_kc_d, k.to(k_cache_ptr.dtype.element_ty), mask=token_ok)
            tl.store(v_cache_ptr + block * stride_vc_b + offset * stride_vc_t + kv_head * stride_vc_h
                     + dims * stride_vc_d, v.to(v_cache_ptr.dtype.element_ty), mask=token_ok)
