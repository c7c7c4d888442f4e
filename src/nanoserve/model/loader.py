"""The model of a local Hugging Face folder (or a GGUF file: model/gguf.py) with its weights on the device.

Weights come from safetensors only (never pickle). The model is built on the meta device and each
tensor is read straight to the target device and dtype, so loading an 8B model costs one pass over
the files and no random init. The folder's config, tokenizer and EOS ids are nanoserve.model_files'.
"""
from __future__ import annotations

import json
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from nanoserve.checkpoint_formats import kv_cache_scheme
from nanoserve.kernels.attention import select_backend
from nanoserve.model import gguf
from nanoserve.model.communicator import TensorParallel
from nanoserve.model.layers import RMSNorm
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.quantization import quantize_model
from nanoserve.model.weights import ParamWriter, hf_names, pieces
from nanoserve.model_files import ModelLoadError, checkpoint_quantization, first_line, is_gguf

_SafetensorError = getattr(safetensors, "SafetensorError", RuntimeError)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def load_model(model_dir: str | Path, hf_config, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto", tp: TensorParallel | None = None, quantization: str | None = None,
               quantize_lm_head: bool = False, progress: bool = False,
               max_model_len: int | None = None) -> LlamaForCausalLM:
    """The model with weights on `device` in `dtype`, attention backends chosen for the device, in eval mode.

    load_format "auto" reads the folder's safetensors; "dummy" fills random weights (std 0.02, norms 1)
    on the device, for benchmarks with real shapes and no files. With tp, only this rank's shards (and only
    their slices of the files) are read. quantization "fp8" then stores the linear layers' weights in fp8
    (model/quantization.py). max_model_len: the engine's (LlamaForCausalLM's RoPE tables).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config, dtype, tp, max_model_len)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(first_line(e)) from None
    if load_format == "dummy":
        _init_dummy(model, dtype, device)
    else:
        # shown only when loading takes over a second (and never for a file refused before its first tensor)
        bar = tqdm(total=len(hf_names(model, dict(model.named_parameters()))), desc="Loading weights",
                   unit="tensor", disable=not progress, delay=1.0, leave=False)
        with bar:
            if is_gguf(model_dir):
                gguf.load_weights(model, model_dir, hf_config, dtype, device, bar.update)
            else:
                _load_safetensors(model, Path(model_dir), hf_config, dtype, device, bar.update)
    try:
        quantize_model(model, quantization, quantize_lm_head)
    except ValueError as e:
        raise ModelLoadError(first_line(e)) from None
    model.to(device)  # the rotary cos/sin table; parameters are already there
    backend = select_backend(device)
    for attn in model.attention_layers():
        attn.backend = backend
    return model.eval()


def _weight_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {str(model_dir)!r} does not exist")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from None
        files = [model_dir / name for name in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"weights file {f.name!r} listed in {index.name} is missing from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("model-*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(f"{model_dir} has only PyTorch pickle weights ({', '.join(pickles[:3])}); "
                             "nanoserve reads safetensors only — convert them (save_pretrained writes safetensors)")
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _load_safetensors(model: LlamaForCausalLM, model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device,
                      on_tensor=lambda names: None) -> None:
    """Every tensor of the folder's files into the model; an FP8 checkpoint's weights stay fp8 with their scales, its
    KV-cache scales go to the attention layers."""
    quant = getattr(hf_config, "quantization_config", None)
    fp8 = checkpoint_quantization(quant, model_dir / "config.json")
    if fp8 is not None and model.spec.moe is not None:
        raise ModelLoadError(f"{model_dir}: fp8 checkpoints of mixture-of-experts models are not supported yet "
                             f"({model.spec.architecture}); use the bf16 checkpoint")
    writer = ParamWriter(model, dtype, device, fp8, kv_cache_scheme(quant, model_dir / "config.json"))
    open_device = str(device) if device.type == "cuda" else "cpu"
    for file in _weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device=open_device) as f:
                for hf_name in f.keys():
                    if writer.is_scale(hf_name):
                        writer.put_scale(hf_name, file.name, f.get_tensor(hf_name))
                        continue
                    for piece in pieces(model, hf_name, f.get_slice(hf_name).get_shape()):
                        found = writer.shard(piece.hf_name, file.name, piece.shape)
                        if found is None:
                            continue
                        name, shard = found
                        tensor = writer.zeros(name) if shard.zeros else _read(f, hf_name, piece.index(shard))
                        on_tensor(writer.put(piece.hf_name, name, shard, tensor))
        except (_SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights file {file}: {first_line(e)}") from None
    writer.finish(f"the weights of {model_dir}")


def _read(f, hf_name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
    """This rank's part of one tensor, as stored: a slice read from the file (get_slice reads only those bytes)."""
    if index is None:
        return f.get_tensor(hf_name)
    return f.get_slice(hf_name)[index].contiguous()


def _init_dummy(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Random weights made directly on the device: normal(0, 0.02) matrices, zero biases, unit norms."""
    generator = torch.Generator(device=device).manual_seed(0)
    for module_name, module in model.named_modules():
        for leaf, param in list(module.named_parameters(recurse=False)):
            tensor = torch.empty(param.shape, dtype=dtype, device=device)
            if isinstance(module, RMSNorm):
                tensor.fill_(1.0)
            elif leaf == "bias":
                tensor.zero_()
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


__all__ = ["load_model"]
