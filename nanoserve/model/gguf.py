"""One GGUF file (llama.cpp's format) → HF config, tokenizer, EOS ids, and weights dequantized at load.

Nothing here parses or dequantizes by hand. transformers reads the config and the tokenizer from the
file's metadata (the code behind `from_pretrained(..., gguf_file=...)`); the `gguf` package reads the
tensor table and dequantizes; GGUF tensor names map to HF names through gguf's own name table, and
llama-family q/k rows are un-permuted by transformers' tensor processor, so the weights are exactly
the ones transformers would load. Tensors are dequantized one at a time and go straight to the
device in the serving dtype: the only full copy of the model is the model.
"""
from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import torch

from nanoserve.model.llama import ModelSpec
from nanoserve.model.loader import ModelLoadError, _as_id_list, _hf_names, _one_line, _set_param, _target
from nanoserve.model.parallel import weight_shard

logger = logging.getLogger("nanoserve")

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MAGIC = b"GGUF"
# GGUF tensors a model of ours can do without: llama.cpp's Llama-3.1 RoPE factors, which transformers ignores too.
_IGNORED_TENSORS = ("rope_freqs.weight",)
# Metadata keys of the tokens that end a generation besides EOS (end of turn, end of message).
_EXTRA_STOP_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_SPECIAL_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                       "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def is_gguf(path: str | Path) -> bool:
    """Whether a model path names a GGUF file (by its suffix, so a bad file still gets GGUF's errors)."""
    return str(path).lower().endswith(".gguf")


def load_config(path: str | Path):
    """The file's metadata as a transformers PretrainedConfig, validated for this engine."""
    from transformers import AutoConfig

    path = Path(path)
    metadata = read_metadata(path)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # gguf/numpy raise ValueError, struct.error, IndexError... for damaged files
        raise ModelLoadError(f"{path} is truncated or corrupt: {_one_line(e)}") from None
    _fill_head_dim(config, metadata, arch)
    try:
        ModelSpec.from_hf_config(config)
    except (ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{path}: {_one_line(e)}") from None
    return config


def read_metadata(path: str | Path) -> dict:
    """The file's metadata keys (string arrays such as the vocabulary come back as their lengths)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"model path {str(path)!r} ends in .gguf but is not a file")
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        import transformers
        raise ModelLoadError(f"loading GGUF files needs transformers >= 5.17 (found {transformers.__version__})") from None
    try:
        metadata, _ = read_gguf_metadata(str(path))
    except (ValueError, struct.error, UnicodeDecodeError, KeyError, IndexError, OverflowError) as e:
        raise ModelLoadError(f"{path} is truncated or corrupt: {_one_line(e)}") from None
    return metadata


def _fill_head_dim(config, metadata: dict, arch: str) -> None:
    """Qwen3's head_dim is not hidden/heads; the file states it, but transformers' mapping reads it only for llama."""
    key_length = metadata.get(f"{arch}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0:
        config.head_dim = key_length


def load_tokenizer(path: str | Path):
    """The tokenizer (vocabulary, merges, chat template) stored in the file.

    Special tokens are set from the file's token ids: transformers 5.17 names the wrong EOS token for
    some files (SmolLM2: <|im_start|>), which would leak into chat templates and skip_special_tokens.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    metadata = read_metadata(path)
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            local_files_only=True)
    except Exception as e:  # transformers raises many types for tokenizers it cannot build
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {_one_line(e)}") from None
    for attribute, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def eos_token_ids(path: str | Path, hf_config, tokenizer=None) -> list[int]:
    """EOS, then end-of-turn / end-of-message ids when the file names them (llama.cpp stops on all of them)."""
    metadata = read_metadata(path)
    ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    for key in _EXTRA_STOP_KEYS:
        for token_id in _as_id_list(metadata.get(key)):
            if token_id not in ids:
                ids.append(token_id)
    if not ids and tokenizer is not None:
        ids = _as_id_list(getattr(tokenizer, "eos_token_id", None))
    return ids


def load_weights(model, path: str | Path, hf_config, dtype: torch.dtype, device: torch.device,
                 on_tensor=lambda: None) -> None:
    """Dequantize every tensor of the file into `model`'s parameters (on `device`, in `dtype`)."""
    from gguf import GGUFReader, dequantize

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # numpy raises ValueError for a tensor that runs past the end of the file
        raise ModelLoadError(f"{path} is truncated or corrupt: {_one_line(e)}") from None
    _check_tensor_types(reader, path)
    arch = str(reader.fields["general.architecture"].contents())
    params = dict(model.named_parameters())
    expected = _hf_names(model, params)
    names = _gguf_to_hf_names(arch, model.num_layers, expected)
    processor = _tensor_processor(arch, hf_config)
    packed: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            if tensor.name in _IGNORED_TENSORS:
                logger.warning("%s: ignoring tensor %r (as transformers does)", path.name, tensor.name)
                continue
            raise ModelLoadError(f"unexpected tensor {tensor.name!r} in {path.name}: the "
                                 f"{model.spec.architecture} model has no such weight")
        target = _target(model, hf_name)
        if target is None:
            continue
        data = np.asarray(tensor.data)  # a plain view: numpy's memmap subclass slows every slice dequantize takes
        weights = processor.process(weights=dequantize(data, tensor.tensor_type), name=tensor.name).weights
        _place(model, params, packed, target, hf_name, weights, path, dtype, device)
        loaded.add(hf_name)
        on_tensor()
    missing = [n for n in expected if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"missing tensor {missing[0]!r}{more} in {path}")
    for name, tensor in packed.items():
        _set_param(model, name, tensor)


def _check_tensor_types(reader, path: Path) -> None:
    """Refuse a file with a tensor type gguf cannot dequantize before any tensor is converted."""
    from gguf import GGML_QUANT_SIZES, dequantize

    checked = set()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype in checked:
            continue
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:  # one zero block: cheap, and asks the installed gguf itself what it can dequantize
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            raise ModelLoadError(f"{path.name}: tensor {tensor.name!r} is stored as {qtype.name}, a type the gguf "
                                 "package cannot dequantize") from None
        checked.add(qtype)


def _gguf_to_hf_names(arch: str, num_layers: int, hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name → HF name, from gguf's table of the HF names each GGUF tensor was written from."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    name_map = get_tensor_name_map(arch_id, num_layers)
    out = {}
    for hf_name in hf_names:
        module, _, leaf = hf_name.rpartition(".")
        gguf_module = name_map.get_name(module)
        if gguf_module is None:
            raise ModelLoadError(f"the gguf package has no GGUF name for the {arch} weight {hf_name!r}")
        out[f"{gguf_module}.{leaf}"] = hf_name
    return out


def _tensor_processor(arch: str, hf_config):
    """transformers' per-architecture GGUF fix-ups (for llama: undo llama.cpp's q/k row permutation)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())


def _place(model, params: dict, packed: dict, target: tuple, hf_name: str, weights: np.ndarray, path: Path,
           dtype: torch.dtype, device: torch.device) -> None:
    """Check one dequantized tensor's shape and copy this rank's part of it into its parameter (or its rows of a
    merged one): the same shards the safetensors loader reads (model/parallel.py)."""
    name, index = target
    param, shard = params[name], weight_shard(model, name, index)
    if tuple(weights.shape) != shard.hf_shape:
        raise ModelLoadError(f"tensor {hf_name!r} in {path.name} has shape {tuple(weights.shape)}, "
                             f"but the model expects {shard.hf_shape}")
    if shard.zeros:
        tensor = torch.zeros(param.shape, dtype=dtype, device=device)
    else:
        part = weights if shard.src is None else weights[shard.src]
        # np.require copies only read-only views of the file (plain F32 tensors), so no parameter aliases the mmap.
        tensor = torch.from_numpy(np.require(part, requirements=["C", "W"])).to(device=device, dtype=dtype)
    if shard.dst_rows is None:
        _set_param(model, name, tensor)
        return
    if name not in packed:
        packed[name] = torch.empty(param.shape, dtype=dtype, device=device)
    packed[name][shard.dst_rows[0]:shard.dst_rows[1]].copy_(tensor)


__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "eos_token_ids", "is_gguf", "load_config", "load_tokenizer",
           "load_weights", "read_metadata"]
