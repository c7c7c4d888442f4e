"""Weight quantization at load: which layers of a loaded model become fp8 (the format is kernels/fp8.py).

`quantization="fp8"` turns every Linear of the decoder layers (qkv, o, gate_up, down) into a float8_e4m3fn
weight with one fp32 scale per output channel (W8A16: activations, the KV cache, embeddings and norms stay in
the serving dtype). The lm_head stays too unless quantize_lm_head: it is the one matrix whose error reaches
the logits unnormalised, and for tied models quantizing it means keeping an fp8 copy beside the embedding.
Per-channel rather than per-128x128-block scales: block scales are not clearly better
(benchmarks/results/fp8_quality.json, real SmolLM2-135M, 16 prompts x 32 tokens, teacher-forced along bf16's
greedy tokens: top-1 agreement 0.930 per channel vs 0.926 per block, mean |Δ logprob| 0.094 vs 0.092, max |Δ logit|
6.9 vs 5.2; every decode matrix's product error 2.6 % both ways), and per-channel costs the GEMV one multiply per
output instead of one per 128 weights.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.config import QUANTIZATIONS
from nanoserve.kernels import fp8
from nanoserve.model.layers import Linear

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_linear(linear: Linear) -> None:
    """Replace linear's weight by its fp8 codes and set its per-channel weight_scale, in place on its device."""
    if linear.weight_scale is not None:
        raise ValueError("this layer is quantized already")
    if linear.weight.dtype not in SOURCE_DTYPES:
        raise ValueError(f"fp8 quantization needs a bf16 / fp16 / fp32 weight, got {linear.weight.dtype}")
    q, scale = fp8.quantize(linear.weight.data)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.weight_scale = scale


def quantize_model(model, quantization: str | None, quantize_lm_head: bool = False) -> None:
    """Quantize a loaded LlamaForCausalLM in place (no-op for quantization=None)."""
    if quantization is None:
        if quantize_lm_head:
            raise ValueError("quantize_lm_head needs quantization='fp8'")
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            quantize_linear(linear)
    if quantize_lm_head:
        if model.lm_head is None:  # tied: an fp8 copy of the embedding projects, the embedding still looks up
            embedding = model.model.embed_tokens.weight
            model.lm_head = Linear(embedding.shape[1], embedding.shape[0], bias=False, device="meta")
            model.lm_head.weight = nn.Parameter(embedding.data, requires_grad=False)
        quantize_linear(model.lm_head)
