"""The Llama family (Llama 2/3, Mistral without sliding window, Qwen2, Qwen3) and its mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) as one model.

They share one shape: pre-norm decoder layers of GQA attention with neox RoPE and a SwiGLU feed-forward, dense or
mixture-of-experts (model/moe.py) per layer. The differences are data read from the HF config (qkv bias, per-head
q/k norm, tied embeddings, head_dim, ModelSpec.moe).
Parameter names follow HF except that q/k/v and gate/up are merged (qkv_proj, gate_up_proj) so a
layer runs two matmuls where HF runs five; the loader concatenates HF's tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels import gemv
from nanoserve.kernels.rotary_kv import QKVRope
from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.model.communicator import TensorParallel, check_sharding, kv_head_split
from nanoserve.model.layers import (MLP, Attention, ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                    VocabParallelEmbedding)
from nanoserve.model.moe import SparseMoE
from nanoserve.model_files import ModelSpec


class LlamaAttentionBlock(nn.Module):
    """qkv projection → (per-head q/k norm) → RoPE + KV store → paged attention → output projection.

    Under tensor parallelism the block holds this rank's query heads and the KV heads they read; o_proj's
    partial products are all-reduced."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        d = spec.head_dim
        q_heads, kv_heads = tp.split(spec.num_heads, "num_attention_heads"), kv_head_split(spec.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim, self.tp = q_heads.size, kv_heads.size, d, tp
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [q_heads.scaled(d), kv_heads.scaled(d),
                                                                kv_heads.scaled(d)], spec.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(q_heads.scaled(d), spec.hidden_size, spec.o_bias, dtype, tp.rank == 0)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm attention of a decoder layer: returns (its output, the residual stream)."""
        attn = self.attn
        if attn.k_cache is None:
            raise RuntimeError("attention layer has no KV cache: the model runner must set k_cache/v_cache first")
        rope = QKVRope(self.num_heads, self.num_kv_heads, self.head_dim, cos_sin_cache, positions, attn.k_cache,
                       attn.v_cache, meta.slot_mapping)
        if self.q_norm is not None:
            rope.q_norm_weight, rope.k_norm_weight, rope.eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        qkv, o = self.qkv_proj, self.o_proj
        q, k, v, residual = gemv.norm_qkv_rope(x, residual, norm.weight, norm.eps, qkv.weight, qkv.bias, rope,
                                               weight_scale=qkv.weight_scale)
        out = attn(q, k, v, meta, kv_stored=True)
        return self.tp.all_reduce(gemv.linear(out.reshape(out.shape[0], -1), o.weight, o.bias,
                                               weight_scale=o.weight_scale)), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp: TensorParallel, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = LlamaAttentionBlock(spec, dtype, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        if spec.moe is not None and spec.moe.sparse_layers[index]:
            self.mlp = SparseMoE(spec, dtype, tp)
        else:
            inter = tp.split(spec.intermediate_size, "intermediate_size")
            self.mlp = MLP(ColumnParallelLinear(spec.hidden_size, [inter, inter], spec.mlp_bias, dtype),
                           RowParallelLinear(inter, spec.hidden_size, spec.mlp_bias, dtype, tp.rank == 0), tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it); their sum is HF's hidden state."""
        x, residual = self.self_attn(x, residual, self.input_layernorm, positions, cos_sin_cache, meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(tp.split(spec.vocab_size, "vocab_size"), spec.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, dtype, tp, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb.cos_sin_cache, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """forward() gives final hidden states, compute_logits() projects the rows the sampler needs.

    Splitting the two lets the runner project only each sequence's last prefill token. Build it on the
    meta device and let nanoserve.model.loader fill the weights; constructing it elsewhere runs a plain init.
    With tp (model/communicator.py) it holds this rank's shards and compute_logits gathers the full vocabulary.
    """

    # HF module name → (our merged module, index of the HF tensor in it); layers.weight_shard places it.
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.hf_config = hf_config
        self.dtype = dtype
        self.tp = tp or TensorParallel()
        check_sharding(self.spec, self.tp.size)
        self.model = LlamaModel(self.spec, dtype, self.tp)
        if self.spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ColumnParallelLinear(self.spec.hidden_size, [self.model.embed_tokens.vocab], False, dtype)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] (int64) → final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] → logits [N, vocab_size] in the model dtype (every rank's slice gathered). A
        tied model gets an lm_head of its own only when quantization gives it an fp8 copy of the embedding."""
        if self.lm_head is None:
            logits = gemv.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return self.tp.all_gather_columns(logits)

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
