"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP, paged attention module.

Everything here is shape-static and free of host syncs, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanoserve.kernels import fused, gemv
from nanoserve.kernels.attention import DecodePartials, paged_attention
from nanoserve.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from nanoserve.model.parallel import TensorParallel

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it first adds it in, returning (normed, new_residual) like vLLM's fused form."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return fused.rms_norm(x, self.weight, self.eps, residual)

    def then(self, linear: "Linear", x: torch.Tensor, residual: torch.Tensor | None):
        """(linear(norm(x + residual)), x + residual); for one decode row the norm runs in the GEMV's prologue."""
        return gemv.norm_linear(x, residual, self.weight, self.eps, linear.weight, linear.bias,
                                weight_scale=linear.weight_scale)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings as one flat dict with rope_type and rope_theta (transformers 4.x or 5.x layout)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_type" not in params and "rope_theta" not in params:
        raise ValueError(f"per-layer RoPE parameters {sorted(params)} are not supported")
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(head_dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale for one RoPE variant.

    Only variants that are a fixed function of the position are supported: their cos/sin can be cached once and
    keys stored in the paged cache stay valid. "dynamic" and "longrope" rescale with the current sequence length.
    """
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = " (it rescales with the sequence length, so cached keys would go stale)" if rope_type in (
            "dynamic", "longrope") else ""
        raise ValueError(f"unsupported rope_type {rope_type!r}{why}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, params, max_position)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(head_dim: int, base: float, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; cos/sin scaled by an attention factor."""
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate-half, as in HF Llama/Qwen) from a cos/sin table precomputed for every position.

    The table is built on the CPU even when the model is constructed on the meta device, and follows the
    model with .to(device). Row p holds [cos, cos, -sin, sin]: kernels.rotary_kv.qk_norm_rope applies it.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = rope_inv_freq(head_dim, params, max_position)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        cache = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)


class Linear(nn.Linear):
    """nn.Linear whose few-row (decode) products go to the Triton GEMV where it beats cuBLAS (kernels/gemv.py).

    weight_scale is None, or with an fp8 weight (model/quantization.py) its fp32 per-output-channel scales."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias, weight_scale=self.weight_scale)


class MLP(nn.Module):
    """SwiGLU MLP with gate and up projections merged into one matmul; SiLU-and-mul feeds the down projection.

    The projections come from model/parallel.py: gate_up column-parallel ([gate slice; up slice] of this
    rank), down row-parallel, whose partial products one all-reduce sums (a no-op on one rank)."""

    def __init__(self, gate_up_proj: Linear, down_proj: Linear, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.tp = gate_up_proj, down_proj, tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm MLP of a decoder layer: returns (its output, the residual stream)."""
        gate_up, residual = norm.then(self.gate_up_proj, x, residual)
        down = self.down_proj
        out = gemv.silu_mul_linear(gate_up, down.weight, down.bias, weight_scale=down.weight_scale)
        return self.tp.all_reduce(out), residual


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, which the model runner allocates and assigns."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.backend = "torch"  # "torch" | "triton", see nanoserve.kernels.attention.select_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta: AttentionMetadata,
                kv_stored: bool = False, defer_merge: bool = False) -> torch.Tensor | DecodePartials:
        """q [T, H, D], k/v [T, Hkv, D] → [T, H, D]; stores k/v at meta.slot_mapping unless kv_stored (k and v
        may then be None: they are in the cache). defer_merge: split-K decode may return its partials, for
        gemv.attention_out_linear to merge."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer has no KV cache: the model runner must set k_cache/v_cache first")
        return paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.backend, kv_stored,
                               defer_merge)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, backend={self.backend}"
