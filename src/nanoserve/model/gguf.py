"""One GGUF file's (llama.cpp's format) weights, dequantized at load; its config, tokenizer and EOS ids are
nanoserve.model_files'.

Nothing here dequantizes by hand: the `gguf` package reads the tensor table and dequantizes; GGUF tensor names
map to HF names through gguf's own name table, and llama-family q/k rows are un-permuted by transformers'
tensor processor, so the weights are exactly the ones transformers would load. Tensors are dequantized one at
a time and go straight to the device in the serving dtype: the only full copy of the model is the model.

Families (gemma2, gemma3, phi3; Mistral files are llama's): llama.cpp stores Gemma's (1 + w) norms as 1 + w;
transformers' Gemma processor subtracts the 1 and ParamWriter adds it back, as for a safetensors folder (in fp32:
the round trip gives the file's 1 + w back bit for bit). Phi-3's fused attn_qkv and ffn_up (gate rows, then up)
are its checkpoint's qkv_proj and gate_up_proj, which pieces() splits as it does the folder's.

Mixtures of experts (qwen2moe, qwen3moe): llama.cpp stacks each layer's experts per projection
(`blk.N.ffn_gate_exps` [E, I, H], `ffn_up_exps`, `ffn_down_exps` [E, H, I]), which gguf's name table knows as
`model.layers.N.mlp.experts.gate_proj`...; ParamWriter places each into its half of our stacked gate_up_proj (or
down_proj), this rank's columns under tp. transformers' processor would merge gate and up into its own state dict
when handed one (its tensor_key_mapping / parsed_parameters); without them it returns expert tensors as stored.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from nanoserve.model.weights import ParamWriter, names_of, pieces
from nanoserve.model_files import ModelLoadError, first_line

logger = logging.getLogger("nanoserve")

# GGUF tensors a model of ours can do without: llama.cpp's Llama-3.1 RoPE factors, which transformers ignores too.
_IGNORED_TENSORS = ("rope_freqs.weight",)
# Qwen2-MoE's shared-expert gate, HF [1, H]: older llama.cpp converters squeezed it to [H], newer ones keep [1, H].
_SHARED_EXPERT_GATE = "ffn_gate_inp_shexp.weight"


def load_weights(model, path: str | Path, hf_config, dtype: torch.dtype, device: torch.device,
                 on_tensor=lambda names: None) -> None:
    """Dequantize every tensor of the file into `model`'s parameters (on `device`, in `dtype`)."""
    from gguf import GGUFReader, dequantize

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # numpy raises ValueError for a tensor that runs past the end of the file
        raise ModelLoadError(f"{path} is truncated or corrupt: {first_line(e)}") from None
    _check_tensor_types(reader, path)
    arch = str(reader.fields["general.architecture"].contents())
    writer = ParamWriter(model, dtype, device)
    processor = _tensor_processor(arch, hf_config)
    names = _gguf_to_hf_names(arch, model.num_layers, _stored_names(model, writer.expected), processor)
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            if tensor.name in _IGNORED_TENSORS:
                logger.warning("%s: ignoring tensor %r (as transformers does)", path.name, tensor.name)
                continue
            raise ModelLoadError(f"unexpected tensor {tensor.name!r} in {path.name}: the "
                                 f"{model.spec.architecture} model has no such weight")
        data = np.asarray(tensor.data)  # a plain view: numpy's memmap subclass slows every slice dequantize takes
        weights = processor.process(weights=dequantize(data, tensor.tensor_type), name=tensor.name).weights
        if tensor.name.endswith(_SHARED_EXPERT_GATE):  # [H] or [1, H] in the file; the processor adds a leading 1
            weights = weights.reshape(1, -1)
        for piece in pieces(model, hf_name, weights.shape):
            found = writer.shard(piece.hf_name, path.name, piece.shape)
            if found is None:
                continue
            name, shard = found
            on_tensor(writer.put(piece.hf_name, name, shard, _part(writer, name, shard, weights, piece.index(shard))))
    writer.finish(path)


def _part(writer: ParamWriter, name: str, shard, weights: np.ndarray, index) -> torch.Tensor:
    """This rank's part of a dequantized tensor, on the writer's device in its dtype."""
    if shard.zeros:
        return writer.zeros(name)
    part = weights if index is None else weights[index]
    # np.require copies only read-only views of the file (plain F32 tensors): no parameter aliases the mmap.
    return torch.from_numpy(np.require(part, requirements=["C", "W"])).to(device=writer.device, dtype=writer.dtype)


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


def _stored_names(model, hf_names: list[str]) -> list[str]:
    """The HF names the file holds: the model's, with the parts of a tensor its family's checkpoint stores fused
    named by that tensor (Phi-3's qkv_proj and gate_up_proj, llama.cpp's attn_qkv and ffn_up; pieces() splits them)."""
    parts_of = {part: whole for whole, parts in names_of(model).fused for part in parts}
    out = []
    for name in hf_names:
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        out.append(f"{parent}.{parts_of[last]}.{leaf}" if last in parts_of else name)
    return list(dict.fromkeys(out))


def _gguf_to_hf_names(arch: str, num_layers: int, hf_names: list[str], processor) -> dict[str, str]:
    """GGUF tensor name → HF name, from gguf's table of the HF names each GGUF tensor was written from.

    The processor's preprocess_name folds per-expert names (`experts.N.gate_proj.weight`) into the stacked
    per-projection name the file holds (`experts.gate_proj.weight`), as transformers' own GGUF loader does.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)
    name_map = get_tensor_name_map(arch_id, num_layers)
    out = {}
    for hf_name in dict.fromkeys(processor.preprocess_name(name) for name in hf_names):
        module, _, leaf = hf_name.rpartition(".")
        gguf_module = name_map.get_name(module)
        if gguf_module is None:
            raise ModelLoadError(f"the gguf package has no GGUF name for the {arch} weight {hf_name!r}")
        out[f"{gguf_module}.{leaf}"] = hf_name
    return out


def _tensor_processor(arch: str, hf_config):
    """transformers' per-architecture GGUF fix-ups (llama: undo llama.cpp's q/k row permutation; qwen2moe and
    qwen3moe: expert names, the shared-expert gate's shape)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())


__all__ = ["load_weights"]
