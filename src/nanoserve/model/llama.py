"""Every dense and mixture-of-experts family we run as one model: Llama 2/3, Mistral, Qwen2/3, Phi-3/4-mini, OLMo-2,
Gemma 2/3 (text), Mixtral, Qwen2-MoE, Qwen3-MoE.

They share one shape: decoder layers of GQA attention with neox RoPE and a gated feed-forward, dense or
mixture-of-experts (model/moe.py) per layer. What differs is data read from the HF config into ModelSpec
(model_files.py): which RMSNorms a layer has (pre-norms, Gemma's sandwich, OLMo-2's post-norms) and Gemma's (1 + w)
weights (added at load, model/weights.py), the activation (SwiGLU / GeGLU), q/k norm per head or over the whole
projection, qkv / o / MLP biases, each layer's sliding window and RoPE table, attention and final-logit soft-caps, the
softmax scale, embedding scaling, tied embeddings. Parameter names follow HF except that q/k/v and gate/up are merged
(qkv_proj, gate_up_proj) so a layer runs two matmuls where HF runs five; the loader fills them (model/weights.py).
Each residual add runs in the kernel of the norm after it, and so does each of Gemma's post-norms (LlamaDecoderLayer).
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels import gemv
from nanoserve.kernels.rotary_kv import QKVRope
from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.model.communicator import TensorParallel, check_sharding, kv_head_split
from nanoserve.model.layers import (MLP, Attention, ColumnParallelLinear, Linear, RMSNorm, RotaryEmbedding,
                                    RowParallelLinear, VocabParallelEmbedding, owed_norm)
from nanoserve.model.moe import SparseMoE
from nanoserve.model_files import ModelSpec

# A layer's RMSNorms by Family.norms, as HF names them: (before attention, on its output, before the MLP, on its output).
NORM_NAMES = {"pre": ("input_layernorm", None, "post_attention_layernorm", None),
              "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"),
              "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm")}


def residual_sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """HF's hidden state: a sub-layer's output plus the residual stream (the embeddings alone before the first)."""
    return x if residual is None else x + residual


def project(norm: RMSNorm | None, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None,
            x_norm: RMSNorm | None = None):
    """(linear(norm(x + residual)), x + residual), x_norm (an owed post-norm) applied to x first; without a pre-norm
    (OLMo-2) the sum itself is projected."""
    if norm is not None:
        return norm.then(linear, x, residual, x_norm)
    h = residual_sum(x if x_norm is None else x_norm(x), residual)
    return linear(h), h


class LlamaAttentionBlock(nn.Module):
    """(pre-norm →) qkv projection → (q/k norm) → RoPE + KV store → paged attention (windowed, soft-capped) → output
    projection.

    Under tensor parallelism the block holds this rank's query heads and the KV heads they read; o_proj's
    partial products are all-reduced."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__()
        d = spec.head_dim
        q_heads, kv_heads = tp.split(spec.num_heads, "num_attention_heads"), kv_head_split(spec.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim, self.tp = q_heads.size, kv_heads.size, d, tp
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [q_heads.scaled(d), kv_heads.scaled(d),
                                                                kv_heads.scaled(d)], spec.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(q_heads.scaled(d), spec.hidden_size, spec.o_bias, dtype, tp.rank == 0)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm is not None:  # "projection" (OLMo-2) runs on one rank: its width is all heads'
            q_width, k_width = (d, d) if spec.qk_norm == "head" else (self.num_heads * d, self.num_kv_heads * d)
            self.q_norm = RMSNorm(q_width, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_width, spec.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, spec.attn_scale or d ** -0.5,
                              sliding_window=spec.window(index), logit_softcap=spec.attn_softcap)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata,
                x_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention of a decoder layer: returns (its output, the residual stream); x_norm: the previous layer's
        owed output norm, applied to x in the input norm's kernel."""
        attn = self.attn
        if attn.k_cache is None:
            raise RuntimeError("attention layer has no KV cache: the model runner must set k_cache/v_cache first")
        rope = QKVRope(self.num_heads, self.num_kv_heads, self.head_dim, cos_sin_cache, positions, attn.k_cache,
                       attn.v_cache, meta.slot_mapping, kv_scales=attn.kv_scales, kv_tail=attn.tail_for(meta),
                       tail_rows=meta.tail_rows)
        qkv, o = self.qkv_proj, self.o_proj
        if norm is not None and self.qk_norm != "projection":  # the fused path: every family but OLMo-2
            if self.q_norm is not None:
                rope.q_norm_weight, rope.k_norm_weight, rope.eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            q, k, v, residual = gemv.norm_qkv_rope(x, residual, norm.weight, norm.eps, qkv.weight, qkv.bias, rope,
                                                   weight_scale=qkv.weight_scale, x_norm=owed_norm(x_norm))
        else:
            out, residual = project(norm, qkv, x, residual, x_norm)
            q, k, v = rope.split(out)
            if self.q_norm is not None:
                q, k = self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
            q, k = rope.apply(q, k, v)
        out = attn(q, k, v, meta, kv_stored=True)
        return self.tp.all_reduce(gemv.linear(out.reshape(out.shape[0], -1), o.weight, o.bias,
                                               weight_scale=o.weight_scale)), residual


class LlamaDecoderLayer(nn.Module):
    """Attention then the feed-forward, each with the RMSNorms its family has around it (NORM_NAMES).

    The residual add before a pre-norm runs inside that norm's kernel. A post-norm followed by a pre-norm (Gemma's
    sandwich) runs in that pre-norm's kernel too, on x before the add: post_attention_layernorm in
    pre_feedforward_layernorm's, post_feedforward_layernorm (returned as owed) in the next layer's input_layernorm
    or the final norm. So a sandwich layer runs two norm kernels, like a pre-norm one. OLMo-2's post-norms, which no
    pre-norm follows, are applied to the sub-layer's output, whose add then happens in `project`."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__()
        self.norm_names = NORM_NAMES[spec.family.norms]
        for name in filter(None, self.norm_names):
            setattr(self, name, RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype))
        self.self_attn = LlamaAttentionBlock(spec, dtype, tp, index)
        self.tp = tp
        if spec.moe is not None and spec.moe.sparse_layers[index]:
            self.mlp = SparseMoE(spec, dtype, tp)
        else:
            inter = tp.split(spec.intermediate_size, "intermediate_size")
            self.mlp = MLP(ColumnParallelLinear(spec.hidden_size, [inter, inter], spec.mlp_bias, dtype),
                           RowParallelLinear(inter, spec.hidden_size, spec.mlp_bias, dtype, tp.rank == 0), tp,
                           activation=spec.activation)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata,
                x_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, RMSNorm | None]:
        """Returns (this layer's output, the residual stream before it, the output's owed norm or None);
        owed(output) + residual is HF's hidden state. x_norm: the previous layer's owed norm."""
        attn_in, attn_out, mlp_in, mlp_out = (getattr(self, n) if n else None for n in self.norm_names)
        x, residual = self.self_attn(x, residual, attn_in, positions, cos_sin_cache, meta, x_norm)
        if mlp_in is not None:  # attn_out, if any, runs in mlp_in's kernel
            x, residual = self.mlp(x, residual, mlp_in, attn_out)
        else:
            residual = residual_sum(x if attn_out is None else attn_out(x), residual)
            x = self.tp.all_reduce(self.mlp.partial(residual))
        if mlp_out is not None and attn_in is None:  # no pre-norm follows (OLMo-2): applied here
            return mlp_out(x), residual, None
        return x, residual, mlp_out


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp: TensorParallel, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(tp.split(spec.vocab_size, "vocab_size"), spec.hidden_size, dtype, tp)
        # Gemma scales the embeddings by sqrt(hidden_size) rounded to the model dtype, as HF does
        self.embed_scale = float(torch.tensor(spec.hidden_size ** 0.5, dtype=dtype, device="cpu")) if spec.family.embed_scale else None
        self.rotary_emb = self._rotary(spec, spec.rope, dtype, max_len)
        self.rotary_emb_local = None if spec.local_rope is None else self._rotary(spec, spec.local_rope, dtype, max_len)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, dtype, tp, i) for i in range(spec.num_layers))
        self.local_layers = [spec.local_rope is not None and spec.layer_rope(i) is spec.local_rope
                             for i in range(spec.num_layers)]
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    @staticmethod
    def _rotary(spec: ModelSpec, params: dict, dtype: torch.dtype, max_len: int) -> RotaryEmbedding:
        """The cos/sin table of max_len positions (the engine's longest sequence fixes LongRoPE's factor set)."""
        rotary_dim = int(spec.head_dim * params["partial_rotary_factor"])
        return RotaryEmbedding(spec.head_dim, max_len, params, dtype, rotary_dim=rotary_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual = owed = None
        for layer, local in zip(self.layers, self.local_layers):
            rotary = self.rotary_emb_local if local else self.rotary_emb
            x, residual, owed = layer(x, residual, positions, rotary.cos_sin_cache, meta, owed)
        x, _ = self.norm(x, residual, owed)
        return x


class LlamaForCausalLM(nn.Module):
    """forward() gives final hidden states, compute_logits() projects the rows the sampler needs.

    Splitting the two lets the runner project only each sequence's last prefill token. Build it on the
    meta device and let nanoserve.model.loader fill the weights; constructing it elsewhere runs a plain init.
    With tp (model/communicator.py) it holds this rank's shards and compute_logits gathers the full vocabulary.
    max_model_len: the engine's longest sequence (default: the config's max_position_embeddings), the positions the
    RoPE tables hold.
    """

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, tp: TensorParallel | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.hf_config = hf_config
        self.dtype = dtype
        self.tp = tp or TensorParallel()
        check_sharding(self.spec, self.tp.size)
        if max_model_len is not None and not 0 < max_model_len <= self.spec.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} must be in 1..max_position_embeddings="
                             f"{self.spec.max_position_embeddings}")
        self.model = LlamaModel(self.spec, dtype, self.tp, max_model_len or self.spec.max_position_embeddings)
        if self.spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ColumnParallelLinear(self.spec.hidden_size, [self.model.embed_tokens.vocab], False, dtype)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] (int64) → final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] → logits [N, vocab_size] in the model dtype (every rank's slice gathered; soft-capped
        where the family caps them, Gemma). A tied model gets an lm_head of its own only when quantization gives it an fp8 copy of the embedding."""
        if self.lm_head is None:
            logits = gemv.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        logits = self.tp.all_gather_columns(logits)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them on one rank)."""
        return kv_head_split(self.spec.num_kv_heads, self.tp).size

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size
