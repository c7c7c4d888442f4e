"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP, paged attention module, and the
tensor-parallel sharded linear and embedding layers (the communicator they reduce over is model/communicator.py).

Everything here is shape-static and free of host syncs, so a decode step can be captured in a CUDA graph.
Sharded layers tell the loader which part of a Hugging Face tensor this rank holds (`weight_shard`), so a rank
reads only its slices of the weight files; with one rank every slice is the whole tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels import fused, gemv
from nanoserve.kernels.attention import check_window_softcap, paged_attention
from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.model.communicator import Split, TensorParallel


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it first adds it in, returning (normed, new_residual) like vLLM's fused form.

    x_norm: a norm still owed to x (Gemma's post-norm of the sub-layer that produced x), applied to x before the add
    in this norm's kernel, so a sandwich layer runs as many norm kernels as a pre-norm one."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, x_norm: "RMSNorm | None" = None):
        return fused.rms_norm(x, self.weight, self.eps, residual, x_norm=owed_norm(x_norm))

    def then(self, linear: "Linear", x: torch.Tensor, residual: torch.Tensor | None, x_norm: "RMSNorm | None" = None):
        """(linear(norm(x_norm(x) + residual)), x_norm(x) + residual); for one decode row the norm runs in the GEMV's
        prologue."""
        return gemv.norm_linear(x, residual, self.weight, self.eps, linear.weight, linear.bias,
                                weight_scale=linear.weight_scale, x_norm=owed_norm(x_norm))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def owed_norm(norm: RMSNorm | None) -> tuple[torch.Tensor, float] | None:
    """The kernels' x_norm argument, (weight, eps), for an owed norm (None: none)."""
    return None if norm is None else (norm.weight, norm.eps)


def rope_inv_freq(head_dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale for one RoPE variant; head_dim is the
    rotated width (rotary_dim under partial rotary, as HF computes it).

    params: nanoserve.rope_config.rope_parameters' checked settings: a variant that is a fixed function of the
    position (its cos/sin is cached once and keys stored in the paged cache stay valid), with every setting it needs.
    """
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, params, max_position)
    if rope_type == "longrope":
        return _longrope_inv_freq(base ** exponents, params, max_position)
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


def _longrope_inv_freq(pos_freqs: torch.Tensor, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3-128k, Phi-4-mini): each frequency slowed by a factor of its own, cos/sin by an attention factor.

    HF picks short_factor while a sequence is at most original_max_position_embeddings long and long_factor beyond,
    recomputing every key when it switches; keys in the paged cache cannot follow, so one set is fixed for the engine
    from its longest position (vLLM's rule): short factors when max_position <= original_max_position_embeddings,
    long otherwise. Greedy tokens therefore equal HF's whenever max_position (the engine's max length) is at most
    original_max_position_embeddings; with a longer max_position, sequences that stay short differ from HF's (which
    would use short factors for them). The attention factor is the config's, else HF's sqrt(1 + ln(factor) /
    ln(original_max_position_embeddings)) from the config's factor (rope_parameters: max_position_embeddings /
    original_max_position_embeddings by default), whichever set is used."""
    old_len = params["original_max_position_embeddings"]
    name = "long_factor" if max_position > old_len else "short_factor"
    ext = torch.tensor(params[name], dtype=torch.float32, device="cpu")
    if ext.shape != pos_freqs.shape:
        raise ValueError(f"longrope {name} has {ext.numel()} values, the rotated head needs {pos_freqs.numel()}")
    factor, attention_factor = params["factor"], params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return 1.0 / (ext * pos_freqs), float(attention_factor)


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

    With rotary_dim < head_dim (partial rotary: Phi-3 / Phi-4-mini, rotary_dim = int(head_dim ·
    partial_rotary_factor)) only the first rotary_dim dims of each head rotate, with the frequencies of a
    rotary_dim-wide head, and the rest pass through, as HF's Phi-3 does; the kernels read rotary_dim from the table's
    width (kernels.rotary_kv.rotary_dim). The table is built on the CPU even when the model is constructed on the meta
    device, and follows the model with .to(device). Row p holds [cos, cos, -sin, sin] (rotary_dim / 2 each):
    kernels.rotary_kv.qk_norm_rope applies it.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and in 1..head_dim={head_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq, scaling = rope_inv_freq(rotary_dim, params, max_position)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        cache = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}"


class Linear(nn.Linear):
    """nn.Linear whose few-row (decode) products go to the Triton GEMV where it beats cuBLAS (kernels/gemv.py).

    weight_scale is None, or with an fp8 weight (model/quantization.py) its fp32 per-output-channel scales."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias, weight_scale=self.weight_scale)


class MLP(nn.Module):
    """Gated MLP (SwiGLU, or GeGLU with activation "gelu_tanh") with gate and up projections merged into one matmul;
    act-and-mul feeds the down projection.

    The projections are the sharded layers below: gate_up column-parallel ([gate slice; up slice] of this
    rank), down row-parallel, whose partial products one all-reduce sums (a no-op on one rank)."""

    def __init__(self, gate_up_proj: Linear, down_proj: Linear, tp: TensorParallel, activation: str = "silu") -> None:
        super().__init__()
        fused.activation_id(activation)  # ValueError for an activation the kernels lack
        self.gate_up_proj, self.down_proj, self.tp, self.activation = gate_up_proj, down_proj, tp, activation

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                x_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm MLP of a decoder layer: returns (its output, the residual stream); x_norm: x's owed
        post-norm (RMSNorm.then)."""
        gate_up, residual = norm.then(self.gate_up_proj, x, residual, x_norm)
        return self.tp.all_reduce(self._down(gate_up)), residual

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's partial product on already-normed rows, not yet reduced (an MoE layer's shared expert)."""
        return self._down(self.gate_up_proj(h))

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        return gemv.silu_mul_linear(gate_up, down.weight, down.bias, weight_scale=down.weight_scale,
                                    activation=self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, which the model runner allocates and assigns.

    sliding_window: each query sees only the last sliding_window keys (itself included); logit_softcap: the scaled
    logits s become logit_softcap * tanh(s / logit_softcap) (Gemma 2). Both per layer (Gemma alternates local and
    global layers); None: off."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        check_window_softcap(sliding_window, logit_softcap)
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # an fp8 cache's scales (kernels/kv_quant.py), set with the cache
        self.v_scale: torch.Tensor | None = None
        self.k_tail: torch.Tensor | None = None  # an fp8 cache's tail (kernels/kv_quant.TAIL_BANKS), set with it
        self.v_tail: torch.Tensor | None = None
        self.backend = "torch"  # "torch" | "triton", see nanoserve.kernels.attention.select_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] → [T, H, D]; stores k/v at meta.slot_mapping unless kv_stored (k and v
        may then be None: they are in the cache)."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer has no KV cache: the model runner must set k_cache/v_cache first")
        return paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.backend, kv_stored,
                               window=self.sliding_window, softcap=self.logit_softcap, kv_scales=self.kv_scales,
                               kv_tail=self.tail_for(meta))

    @property
    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of an fp8 cache; None for a cache in the model's dtype."""
        return None if self.k_scale is None else (self.k_scale, self.v_scale)

    def tail_for(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_tail, v_tail) of an fp8 cache that keeps one; a step over it must say where its tokens go."""
        if self.k_tail is None:
            return None
        if meta.tail_rows is None or meta.table_rows is None:
            raise RuntimeError("an fp8 KV cache with a tail needs the step's tail_rows and table_rows (slots)")
        return self.k_tail, self.v_tail

    def extra_repr(self) -> str:
        options = "".join(f", {name}={value}" for name, value in (("sliding_window", self.sliding_window),
                                                                   ("logit_softcap", self.logit_softcap))
                          if value is not None)
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{options}, "
                f"backend={self.backend}")


@dataclass(frozen=True)
class WeightShard:
    """Where one Hugging Face tensor goes on this rank: hf[src] → param rows dst_rows, or param[dst_index] (None for
    both: the whole param)."""

    hf_shape: tuple[int, ...]  # the checkpoint tensor's full shape
    src: tuple[slice, ...] | None  # this rank's part of it; None: all of it
    dst_rows: tuple[int, int] | None = None  # rows of a merged parameter (qkv, gate_up)
    zeros: bool = False  # a row-parallel bias off rank 0: zeros, so the all-reduce adds rank 0's bias once
    dst_index: tuple | None = None  # an index into a stacked parameter (experts: one expert, one of gate/up)
    pieces: tuple[slice, ...] | None = None  # dim-1 slices of what src read, concatenated (stacked gate_up under tp)

    def assemble(self, tensor: torch.Tensor) -> torch.Tensor:
        """What src read, as the parameter (or its dst part) takes it."""
        if self.pieces is None:
            return tensor
        return torch.cat([tensor[:, piece] for piece in self.pieces], dim=1)


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks. `parts` are the stacked HF tensors (q, k, v or gate, up; one for an
    lm_head), each split on its own, so this rank's weight is [q slice; k slice; v slice]."""

    def __init__(self, in_features: int, parts: list[Split], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(p.size for p in parts), bias=bias, dtype=dtype)
        self.parts = tuple(parts)

    def weight_shard(self, leaf: str, index: int | None) -> WeightShard:
        i = index or 0
        part, offset = self.parts[i], sum(p.size for p in self.parts[:i])
        shape = (part.full, self.in_features) if leaf == "weight" else (part.full,)
        dst = None if len(self.parts) == 1 else (offset, offset + part.size)
        return WeightShard(shape, (slice(part.start, part.stop),), dst)


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the caller all-reduces the partial products. Only rank 0 holds the
    bias, so it is added once and the GEMV still adds it in its epilogue."""

    def __init__(self, columns: Split, out_features: int, bias: bool, dtype: torch.dtype, holds_bias: bool) -> None:
        super().__init__(columns.size, out_features, bias=bias, dtype=dtype)
        self.columns, self.holds_bias = columns, holds_bias

    def weight_shard(self, leaf: str, index: int | None) -> WeightShard:
        c = self.columns
        if leaf == "weight":
            return WeightShard((self.out_features, c.full), (slice(None), slice(c.start, c.stop)))
        return WeightShard((self.out_features,), None, zeros=not self.holds_bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding; a token outside them looks up zeros, and the all-reduce fills in
    the rank that holds it. Its weight doubles as the tied lm_head's slice of the vocabulary."""

    def __init__(self, vocab: Split, hidden_size: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.weight = nn.Parameter(torch.empty(vocab.size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def weight_shard(self, leaf: str, index: int | None) -> WeightShard:
        return WeightShard((self.vocab.full, self.weight.shape[1]), (slice(self.vocab.start, self.vocab.stop),))

    def extra_repr(self) -> str:
        return f"rows {self.vocab.start}..{self.vocab.stop} of {self.vocab.full}, {self.weight.shape[1]}"


def weight_shard(model: nn.Module, name: str, index) -> WeightShard:
    """The shard of parameter `name` (HF tensor `index` of a merged or stacked one) that this rank loads: the
    sharded layers (and model/moe.py's experts) say; any other parameter is replicated."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if hasattr(module, "weight_shard"):
        return module.weight_shard(leaf, index)
    return WeightShard(tuple(getattr(module, leaf).shape), None)  # replicated: norms
