"""FP8 weights at load: which layers of a loaded model become fp8 (the format is kernels/fp8.py), and the scales
of a pre-quantized FP8 checkpoint put together for this rank's layers (Fp8Scales).

`quantization="fp8"` turns every Linear of the decoder layers (qkv, o, gate_up, down) into a float8_e4m3fn
weight with one fp32 scale per output channel (W8A16: activations, the KV cache, embeddings and norms stay in
the serving dtype). The lm_head stays too unless quantize_lm_head: it is the one matrix whose error reaches
the logits unnormalised, and for tied models quantizing it means keeping an fp8 copy beside the embedding.
Per-channel rather than per-128x128-block scales: block scales are not clearly better
(benchmarks/results/fp8_quality.json, real SmolLM2-135M, 16 prompts x 32 tokens, teacher-forced along bf16's
greedy tokens: top-1 agreement 0.930 per channel vs 0.926 per block, mean |Δ logprob| 0.094 vs 0.092, max |Δ logit|
6.9 vs 5.2; every decode matrix's product error 2.6 % both ways), and per-channel costs the GEMV one multiply per
output instead of one per 128 weights.

Pre-quantized checkpoints keep their codes and scales exactly: per-channel and 128x128-block scales as stored,
a per-tensor scale repeated over its rows (so merged q/k/v or gate/up parts with scales of their own stay exact).
Their per-layer KV-cache scales (CheckpointKVScales) go to each layer's Attention as `checkpoint_kv_scales`, for an
fp8 KV cache with per-layer scales (runner/kv_cache.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nanoserve.config import FP8_BLOCK, QUANTIZATIONS
from nanoserve.kernels import fp8
from nanoserve.model.layers import Attention, Linear, WeightShard
from nanoserve.model_files import Fp8Checkpoint, ModelLoadError

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A layer's KV-cache scale tensors, by their name after `self_attn.` (the names pre-quantized checkpoints use, as vLLM
# reads them: compressed-tensors, ModelOpt, the older single kv_scale) → the scales each gives, K and / or V
KV_SCALE_NAMES = {"k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v",
                  "k_proj.k_scale": "k", "v_proj.v_scale": "v", "k_proj.output_scale": "k",
                  "v_proj.output_scale": "v", "kv_scale": "kv"}
_ATTENTION = ".self_attn."


def quantize_linear(linear: Linear) -> None:
    """Replace linear's weight by its fp8 codes and set its per-channel weight_scale, in place on its device
    (a layer a pre-quantized checkpoint stored in fp8 stays as it is)."""
    if linear.weight_scale is not None:
        return
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
    if model.spec.moe is not None:
        raise ValueError(f"quantization={quantization!r} does not cover mixture-of-experts weights yet; serve "
                         f"{model.spec.architecture} in bf16 (no --quantization)")
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


def scale_layout(scale_shape: tuple[int, ...], weight_shape: tuple[int, int], allowed: tuple[str, ...]) -> str | None:
    """Which of the checkpoint's layouts ("tensor", "channel", "block") a scale of this shape is, or None."""
    n, k = weight_shape
    shapes = {"tensor": ((), (1,)), "channel": ((n,), (n, 1)),
              "block": ((-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)),)}
    return next((kind for kind in allowed if tuple(scale_shape) in shapes[kind]), None)


def _span(part: slice, size: int, block: int, what: str) -> slice:
    """The blocks of a slice of `size` rows or columns, which must start and end on block borders."""
    start, stop, _ = part.indices(size)
    if start % block or (stop % block and stop != size):
        raise ModelLoadError(f"{what} {start}..{stop} of a {FP8_BLOCK}x{FP8_BLOCK}-block fp8 weight do not "
                             f"fall on block borders: this layout cannot be split there (tensor parallelism "
                             "or a merged q/k/v or gate/up projection)")
    return slice(start // block, -(-stop // block))


def local_scale(scale: torch.Tensor, layout: str, shard: WeightShard, hf_name: str) -> torch.Tensor:
    """This rank's part of a weight's stored scales: fp32 [rows] per channel (a per-tensor scale repeated), or
    [row blocks, column blocks] per block."""
    n, k = shard.hf_shape
    src = shard.src or ()
    rows = src[0] if src else slice(None)
    cols = src[1] if len(src) > 1 else slice(None)
    scale = scale.float()
    if layout == "block":
        return scale[_span(rows, n, FP8_BLOCK, f"{hf_name}: rows"),
                     _span(cols, k, FP8_BLOCK, f"{hf_name}: columns")].contiguous()
    start, stop, _ = rows.indices(n)
    if layout == "tensor":
        return scale.reshape(()).expand(stop - start).contiguous()
    return scale.reshape(n)[start:stop].contiguous()


class Fp8Scales:
    """The scales of a pre-quantized checkpoint, collected tensor by tensor (in any file order) and set on the
    layers whose weights the checkpoint stores in fp8, once all are read."""

    def __init__(self, model, checkpoint: Fp8Checkpoint, device: torch.device):
        self.model, self.checkpoint, self.device = model, checkpoint, device
        self.parts: dict[str, list[tuple[WeightShard, str, torch.Tensor, str]]] = {}

    def add(self, name: str, shard: WeightShard, scale: torch.Tensor, hf_name: str) -> None:
        """A stored scale for parameter `name` (the weight), whose HF weight tensor `shard` describes."""
        layout = scale_layout(tuple(scale.shape), shard.hf_shape, self.checkpoint.scales)
        if layout is None:
            raise ModelLoadError(f"{hf_name} has shape {tuple(scale.shape)}, not a {' / '.join(self.checkpoint.scales)} "
                                 f"scale of a {shard.hf_shape} weight ({self.checkpoint.method} checkpoint)")
        local = local_scale(scale, layout, shard, hf_name)
        self.parts.setdefault(name, []).append((shard, "block" if layout == "block" else "channel", local, hf_name))

    def finish(self, fp8_weights: dict[str, str], source) -> None:
        """Set weight_scale on every layer stored in fp8 (fp8_weights: each fp8 HF weight → its parameter)."""
        scaled = {hf_name.rpartition(".")[0] + ".weight" for parts in self.parts.values() for *_, hf_name in parts}
        for hf_name in fp8_weights:
            if hf_name not in scaled:
                prefix = hf_name.rpartition(".")[0]
                raise ModelLoadError(f"missing tensor '{prefix}.{self.checkpoint.scale_name}' in {source}: the "
                                     f"fp8 weight {hf_name!r} needs its scales")
        for hf_name in scaled - set(fp8_weights):
            raise ModelLoadError(f"{source} stores scales for {hf_name!r}, which is not an fp8 weight")
        for name, parts in self.parts.items():
            module = self.model.get_submodule(name.rpartition(".")[0])
            if not isinstance(module, Linear):
                raise ModelLoadError(f"{source} stores {name!r} in fp8; nanoserve takes fp8 linear layers only")
            module.weight_scale = _merged(parts, module, name).to(self.device)


def _merged(parts, module: Linear, name: str) -> torch.Tensor:
    """One layer's scales from its parts (q/k/v or gate/up of a merged projection, in their rows)."""
    layouts = {layout for _, layout, _, _ in parts}
    if len(layouts) > 1:
        raise ModelLoadError(f"the parts of {name!r} mix per-block and per-channel fp8 scales")
    if len(parts) == 1 and parts[0][0].dst_rows is None:
        return parts[0][2]
    n, k = module.weight.shape
    block = layouts == {"block"}
    out = torch.empty((-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)) if block else (n,), dtype=torch.float32)
    for shard, _, local, hf_name in parts:
        start, stop = shard.dst_rows
        if block:
            rows = _span(slice(start, stop), n, FP8_BLOCK, f"{hf_name}: merged into {name}, rows")
            out[rows] = local
        else:
            out[start:stop] = local
    return out


def kv_scale_target(hf_name: str) -> tuple[str, str] | None:
    """(the Attention module, "k" / "v" / "kv") that a checkpoint's KV-cache scale tensor belongs to; None for any
    other tensor."""
    layer, found, rest = hf_name.partition(_ATTENTION)
    if not found or rest not in KV_SCALE_NAMES:
        return None
    return f"{layer}{_ATTENTION}attn", KV_SCALE_NAMES[rest]


class CheckpointKVScales:
    """A checkpoint's per-layer KV-cache scales (one value each for K and V, the same on every tensor-parallel
    rank), collected tensor by tensor and set on the layers' Attention modules as `checkpoint_kv_scales` = (k, v)."""

    def __init__(self, model):
        self.model = model
        self.found: dict[str, dict[str, float]] = {}  # Attention module → {"k": scale, "v": scale}

    def add(self, hf_name: str, file_name: str, scale: torch.Tensor) -> None:
        module, parts = kv_scale_target(hf_name)
        try:
            attn = self.model.get_submodule(module)
        except AttributeError:
            attn = None
        if not isinstance(attn, Attention):
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in {file_name}: the "
                                 f"{self.model.spec.architecture} model has no attention layer {module!r}")
        if scale.numel() != 1:
            raise ModelLoadError(f"KV-cache scale {hf_name!r} in {file_name} has shape {tuple(scale.shape)}; "
                                 "one value per layer expected")
        value = float(scale.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"KV-cache scale {hf_name!r} in {file_name} is {value}: it must be finite and "
                                 "positive")
        held = self.found.setdefault(module, {})
        for part in parts:
            if held.setdefault(part, value) != value:
                raise ModelLoadError(f"{file_name} gives {module!r} two {part.upper()} scales, {held[part]} and "
                                     f"{value} ({hf_name!r})")

    def finish(self, scheme: bool, source) -> None:
        """Set each layer's (k, v); a KV-cache scheme without scale tensors, or a layer with one of the two, is an
        error."""
        if scheme and not self.found:
            raise ModelLoadError(f"{source}: quantization_config.kv_cache_scheme is set, but the checkpoint has no "
                                 "k_scale / v_scale tensors")
        for module, held in self.found.items():
            if len(held) < 2:
                have = next(iter(held))
                raise ModelLoadError(f"{source} has a {have.upper()} scale for {module!r} but no "
                                     f"{'V' if have == 'k' else 'K'} scale")
            self.model.get_submodule(module).checkpoint_kv_scales = (held["k"], held["v"])
