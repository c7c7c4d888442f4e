"""The weight formats a checkpoint may be stored in, read from its quantization_config: pre-quantized FP8 layouts
(the 'fp8' method and compressed-tensors FP8), and a one-line refusal for every other stored format, before any
weight is read. Also its KV-cache scheme (compressed-tensors' kv_cache_scheme): per-layer fp8 K/V scales stored
beside the weights, which an fp8 KV cache (--kv-cache-dtype fp8) uses as stored."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanoserve.config import FP8_BLOCK
from nanoserve.errors import ModelLoadError


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a pre-quantized FP8 checkpoint stores its linear weights: float8_e4m3fn codes in `<module>.weight`
    beside fp32 scales in `<module>.<scale_name>`, of the layouts in `scales` (each tensor's shape says which):
    "block" (one per 128x128 tile), "channel" (one per output row), "tensor" (one). Activation scales stored
    for static quantization are not needed: activations stay in the serving dtype (W8A16) or are quantized per
    token as they are used."""

    method: str  # quantization_config.quant_method
    scale_name: str
    scales: tuple[str, ...]


_FP8_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors formats that store fp8 values as is


def checkpoint_quantization(quant, source: Path | str) -> Fp8Checkpoint | None:
    """The FP8 layout of a checkpoint from its quantization_config (None: not quantized); any other stored
    format (GPTQ, AWQ, int4/int8, fp8 e5m2, other block sizes) is one ModelLoadError line naming it."""
    if not quant:
        return None
    kv_cache_scheme(quant, source)
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    if method == "fp8":
        return _fp8_method(quant, source)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    raise ModelLoadError(f"{source}: the checkpoint is stored quantized (quantization_config.quant_method="
                         f"{method!r}), a weight format nanoserve cannot load; it loads FP8 checkpoints "
                         "('fp8' and 'compressed-tensors' FP8) and float32/bfloat16/float16 ones (--quantization fp8 "
                         "quantizes one at load)")


def _fp8_method(quant: dict, source) -> Fp8Checkpoint:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"{source}: fp8 checkpoint in format {fmt!r}; nanoserve loads e4m3 only")
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8Checkpoint("fp8", "weight_scale", ("tensor", "channel"))
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ModelLoadError(f"{source}: fp8 checkpoint with weight_block_size {list(block)}; nanoserve loads "
                             f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks, per-channel and per-tensor scales")
    return Fp8Checkpoint("fp8", "weight_scale_inv", ("block",))


def _compressed_tensors(quant: dict, source) -> Fp8Checkpoint:
    """compressed-tensors: every config group must hold 8-bit float weights (channel, tensor or 128x128 block
    strategy) and 8-bit float or no input activations."""
    fmt = quant.get("format")
    if fmt not in _FP8_FORMATS:
        raise ModelLoadError(f"{source}: compressed-tensors checkpoint in format {fmt!r}; nanoserve loads FP8 "
                             f"weights stored {' or '.join(map(repr, _FP8_FORMATS))}")
    if quant.get("sparsity_config"):
        raise ModelLoadError(f"{source}: compressed-tensors checkpoint with a sparsity_config; nanoserve loads "
                             "dense FP8 weights only")
    groups = quant.get("config_groups") or {}
    if not groups and quant.get("kv_cache_scheme"):
        return None  # KV-cache scales only: the weights are stored unquantized
    if not groups:
        raise ModelLoadError(f"{source}: compressed-tensors checkpoint without config_groups")
    scales = set()
    for name, group in groups.items():
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        what = (weights.get("type"), weights.get("num_bits"))
        strategy = weights.get("strategy")
        if what != ("float", 8) or strategy not in ("channel", "tensor", "block"):
            raise ModelLoadError(f"{source}: compressed-tensors group {name!r} stores {what[1]}-bit {what[0]} "
                                 f"weights with strategy {strategy!r}; nanoserve loads 8-bit float weights with "
                                 "channel, tensor or block strategy")
        if strategy == "block" and list(weights.get("block_structure") or []) != [FP8_BLOCK, FP8_BLOCK]:
            raise ModelLoadError(f"{source}: compressed-tensors group {name!r} has block_structure "
                                 f"{weights.get('block_structure')}; nanoserve loads [{FP8_BLOCK}, {FP8_BLOCK}]")
        if acts and (acts.get("type"), acts.get("num_bits")) != ("float", 8):
            raise ModelLoadError(f"{source}: compressed-tensors group {name!r} quantizes activations to "
                                 f"{acts.get('num_bits')}-bit {acts.get('type')}; nanoserve takes FP8 or none")
        scales.add(strategy)
    return Fp8Checkpoint("compressed-tensors", "weight_scale", tuple(sorted(scales)))


def kv_cache_scheme(quant, source: Path | str) -> bool:
    """Whether quantization_config declares a KV-cache scheme (then the checkpoint must carry per-layer K/V scales:
    the loader checks); a scheme other than static, symmetric 8-bit float per tensor is one ModelLoadError line."""
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if not scheme:
        return False
    if not isinstance(scheme, dict):
        raise ModelLoadError(f"{source}: quantization_config.kv_cache_scheme must be an object, got {scheme!r}")
    kind = (scheme.get("num_bits"), scheme.get("type"), scheme.get("strategy"))
    if kind != (8, "float", "tensor") or scheme.get("dynamic") or scheme.get("symmetric") is False:
        raise ModelLoadError(f"{source}: quantization_config.kv_cache_scheme is {kind[0]}-bit {kind[1]} per "
                             f"{kind[2]} (dynamic={scheme.get('dynamic')}, symmetric={scheme.get('symmetric')}); "
                             "nanoserve loads static symmetric 8-bit float KV-cache scales per tensor (one per layer "
                             "for K and one for V)")
    return True


__all__ = ["Fp8Checkpoint", "checkpoint_quantization", "kv_cache_scheme"]
