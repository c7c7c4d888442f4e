"""A local Hugging Face folder (or a GGUF file: model/gguf.py) → config, model with weights on the device,
tokenizer, EOS ids.

Weights come from safetensors only (never pickle). The model is built on the meta device and each
tensor is read straight to the target device and dtype, so loading an 8B model costs one pass over
the files and no random init.
"""
from __future__ import annotations

import json
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from nanoserve.kernels.attention import select_backend
from nanoserve.model.layers import RMSNorm
from nanoserve.model.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelSpec
from nanoserve.model.quantization import quantize_model
from nanoserve.model.parallel import TensorParallel, WeightShard, weight_shard

_SafetensorError = getattr(safetensors, "SafetensorError", RuntimeError)
# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file or tensor at fault."""


def load_hf_config(model_dir: str | Path):
    """The folder's config.json as a transformers PretrainedConfig, validated for this engine."""
    from transformers import AutoConfig

    if _gguf().is_gguf(model_dir):
        return _gguf().load_config(model_dir)
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in model folder {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(f"unsupported architecture {archs} in {config_file}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError/TypeError for bad configs
        raise ModelLoadError(f"cannot parse {config_file}: {_one_line(e)}") from None
    try:
        ModelSpec.from_hf_config(config)
    except (ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{config_file}: {_one_line(e)}") from None
    _check_not_prequantized(raw, config_file)
    return config


def _check_not_prequantized(raw: dict, config_file: Path) -> None:
    """A checkpoint stored quantized (GPTQ, AWQ, fp8, ...) has tensors this loader cannot read: say so before
    reading any of them."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ModelLoadError(f"{config_file}: the checkpoint is stored quantized (quantization_config.quant_method="
                             f"{method!r}), a weight format nanoserve cannot load; give a float32/bfloat16/float16 "
                             "checkpoint (--quantization fp8 quantizes one at load)")


def model_max_len(hf_config) -> int:
    return int(hf_config.max_position_embeddings)


def load_model(model_dir: str | Path, hf_config, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto", tp: TensorParallel | None = None, quantization: str | None = None,
               quantize_lm_head: bool = False, progress: bool = False) -> LlamaForCausalLM:
    """The model with weights on `device` in `dtype`, attention backends chosen for the device, in eval mode.

    load_format "auto" reads the folder's safetensors; "dummy" fills random weights (std 0.02, norms 1)
    on the device, for benchmarks with real shapes and no files. With tp, only this rank's shards (and only
    their slices of the files) are read. quantization "fp8" then stores the linear layers' weights in fp8
    (model/quantization.py).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config, dtype, tp)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(_one_line(e)) from None
    if load_format == "dummy":
        _init_dummy(model, dtype, device)
    else:
        # shown only when loading takes over a second (and never for a file refused before its first tensor)
        bar = tqdm(total=len(_hf_names(model, dict(model.named_parameters()))), desc="Loading weights",
                   unit="tensor", disable=not progress, delay=1.0, leave=False)
        with bar:
            if _gguf().is_gguf(model_dir):
                _gguf().load_weights(model, model_dir, hf_config, dtype, device, bar.update)
            else:
                _load_safetensors(model, Path(model_dir), dtype, device, bar.update)
    try:
        quantize_model(model, quantization, quantize_lm_head)
    except ValueError as e:
        raise ModelLoadError(_one_line(e)) from None
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


def _load_safetensors(model: LlamaForCausalLM, model_dir: Path, dtype: torch.dtype, device: torch.device,
                      on_tensor=lambda: None) -> None:
    params = dict(model.named_parameters())
    packed: dict[str, torch.Tensor] = {}  # merged params being filled shard by shard
    expected = set(_hf_names(model, params))
    loaded: set[str] = set()
    open_device = str(device) if device.type == "cuda" else "cpu"
    for file in _weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device=open_device) as f:
                for hf_name in f.keys():
                    target = _target(model, hf_name)
                    if target is None:
                        continue
                    name, index = target
                    if name not in params:
                        raise ModelLoadError(f"unexpected tensor {hf_name!r} in {file.name}: the "
                                             f"{model.spec.architecture} model has no such weight")
                    param, shard = params[name], weight_shard(model, name, index)
                    got = tuple(f.get_slice(hf_name).get_shape())
                    if got != shard.hf_shape:
                        raise ModelLoadError(f"tensor {hf_name!r} in {file.name} has shape {got}, "
                                             f"but the model expects {shard.hf_shape}")
                    tensor = _read(f, hf_name, shard, param, dtype, device)
                    rows = shard.dst_rows
                    if rows is None:
                        _set_param(model, name, tensor)
                    else:
                        if name not in packed:
                            packed[name] = torch.empty(param.shape, dtype=dtype, device=device)
                        packed[name][rows[0]:rows[1]].copy_(tensor)
                    loaded.add(hf_name)
                    on_tensor()
        except (_SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights file {file}: {_one_line(e)}") from None
    missing = sorted(expected - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"missing tensor {missing[0]!r}{more} in the weights of {model_dir}")
    for name, tensor in packed.items():
        _set_param(model, name, tensor)


def _read(f, hf_name: str, shard: WeightShard, param: nn.Parameter, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """This rank's part of one tensor: a slice read from the file (get_slice reads only those bytes)."""
    if shard.zeros:
        return torch.zeros(param.shape, dtype=dtype, device=device)
    if shard.src is None:
        return f.get_tensor(hf_name).to(dtype)
    return f.get_slice(hf_name)[shard.src].to(dtype).contiguous()


def _target(model: LlamaForCausalLM, hf_name: str) -> tuple[str, int | None] | None:
    """HF tensor name → (our parameter, index of the HF tensor inside a merged weight or None); None to skip it."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None  # tied: the embedding is the output projection
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        merged, index = model.packed_modules[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), index
    return hf_name, None


def _hf_names(model: LlamaForCausalLM, params: dict[str, nn.Parameter]) -> list[str]:
    """The HF tensor names a complete checkpoint must contain for these parameters."""
    unpacked: dict[str, list[str]] = {}
    for hf_module, (merged, shard) in model.packed_modules.items():
        unpacked.setdefault(merged, []).insert(shard, hf_module)
    names = []
    for name in params:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in unpacked:
            names += [".".join(parts[:-2] + [m, parts[-1]]) for m in unpacked[parts[-2]]]
        else:
            names.append(name)
    return names


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


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


def load_tokenizer(model_dir: str | Path):
    """The folder's tokenizer (AutoTokenizer, local files only)."""
    from transformers import AutoTokenizer

    if _gguf().is_gguf(model_dir):
        return _gguf().load_tokenizer(model_dir)
    path = Path(model_dir)
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer folder {str(path)!r} does not exist")
    if not any((path / f).is_file() for f in files):
        raise ModelLoadError(f"no tokenizer in {str(path)!r} (expected one of {', '.join(files)})")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ModelLoadError(f"cannot load the tokenizer in {str(path)!r}: {_one_line(e)}") from None


def eos_token_ids(model_dir: str | Path, hf_config, tokenizer=None) -> list[int]:
    """Token ids that end a generation: generation_config.json, else config.json, else the tokenizer's EOS."""
    if _gguf().is_gguf(model_dir):
        return _gguf().eos_token_ids(model_dir, hf_config, tokenizer)
    gen_file = Path(model_dir) / "generation_config.json"
    if gen_file.is_file():
        try:
            ids = _as_id_list(json.loads(gen_file.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"{gen_file} is not valid JSON: {e}") from None
        if ids:
            return ids
    ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    if ids:
        return ids
    if tokenizer is not None:
        return _as_id_list(getattr(tokenizer, "eos_token_id", None))
    return []


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    out: list[int] = []
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v not in out:
            out.append(v)
    return out


def _gguf():
    """nanoserve.model.gguf, imported on first use: it builds on this module, and only GGUF models need it."""
    from nanoserve.model import gguf

    return gguf


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["ModelLoadError", "load_hf_config", "load_model", "load_tokenizer", "eos_token_ids", "model_max_len"]
