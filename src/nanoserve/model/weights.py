"""What both weight readers share (safetensors in model/loader.py, GGUF in model/gguf.py): Hugging Face tensor
names ↔ our parameters, and writing this rank's part of each tensor into them.

Our parameters follow HF's names except the merged ones (qkv_proj, gate_up_proj: `packed_modules` of the
model); a merged parameter is filled shard by shard in a buffer and set once every part is in.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels.fp8 import FP8_DTYPE
from nanoserve.model.layers import WeightShard, weight_shard
from nanoserve.model.moe import Experts, covered_names, expert_target
from nanoserve.model.quantization import Fp8Scales
from nanoserve.model_files import Fp8Checkpoint, ModelLoadError

# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# FP8 checkpoints' scales for static activation (and KV-cache) quantization: activations stay in the serving
# dtype or are quantized per token where they are used, the KV cache in the serving dtype.
_ACTIVATION_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale")


def target(model, hf_name: str) -> tuple[str, object] | None:
    """HF tensor name → (our parameter, index of the HF tensor inside a merged or stacked weight or None); None to
    skip it."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None  # tied: the embedding is the output projection
    hf_name = canonical_name(model, hf_name)
    parts = hf_name.split(".")
    if model.spec.moe is not None and "experts" in parts:
        return expert_target(parts) or (hf_name, None)
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        merged, index = model.packed_modules[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), index
    return hf_name, None


def canonical_name(model, hf_name: str) -> str:
    """The name our tables know a checkpoint tensor by: Mixtral's `block_sparse_moe` is the `mlp` of the others."""
    if model.spec.moe is None or "block_sparse_moe" not in hf_name:
        return hf_name
    return ".".join("mlp" if p == "block_sparse_moe" else p for p in hf_name.split("."))


def hf_names(model, params: dict[str, nn.Parameter]) -> list[str]:
    """The HF tensor names a complete checkpoint must contain for these parameters."""
    unpacked: dict[str, list[str]] = {}
    for hf_module, (merged, shard) in model.packed_modules.items():
        unpacked.setdefault(merged, []).insert(shard, hf_module)
    names = []
    for name in params:
        parts = name.split(".")
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Experts):
            names += module.hf_names(module_name, leaf)
        elif len(parts) >= 2 and parts[-2] in unpacked:
            names += [".".join(parts[:-2] + [m, parts[-1]]) for m in unpacked[parts[-2]]]
        else:
            names.append(name)
    return names


def set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


class ParamWriter:
    """Writes one checkpoint's tensors into `model`'s parameters (on `device`, in `dtype`): finds each HF tensor's
    parameter and this rank's shard of it, checks the shape, and fills merged parameters part by part. With an
    FP8 checkpoint (fp8) its fp8 weights stay fp8 and their scales go to the layers' weight_scale."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device, fp8: Fp8Checkpoint | None = None):
        self.model, self.dtype, self.device = model, dtype, device
        self.params = dict(model.named_parameters())
        self.expected = hf_names(model, self.params)
        self.loaded: set[str] = set()
        self._packed: dict[str, torch.Tensor] = {}  # merged params being filled shard by shard
        self.fp8 = fp8
        self.scales = Fp8Scales(model, fp8, device) if fp8 is not None else None
        self.fp8_weights: dict[str, str] = {}  # HF weights stored in fp8 → their parameter
        self._covers: dict[str, list[str]] = {}  # a stacked expert tensor → the per-expert names it fills

    def is_scale(self, hf_name: str) -> bool:
        """Whether an FP8 checkpoint's tensor is a weight's scales (then put_scale takes it, whole)."""
        return self.fp8 is not None and hf_name.rpartition(".")[2] == self.fp8.scale_name

    def put_scale(self, hf_name: str, file_name: str, scale: torch.Tensor) -> None:
        weight = hf_name.rpartition(".")[0] + ".weight"
        found = target(self.model, weight)
        if found is None or found[0] not in self.params:
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in {file_name}: the "
                                 f"{self.model.spec.architecture} model has no weight {weight!r} to scale")
        name, index = found
        self.scales.add(name, weight_shard(self.model, name, index), scale, hf_name)

    def shard(self, hf_name: str, file_name: str, shape: tuple[int, ...]) -> tuple[str, WeightShard] | None:
        """(our parameter, this rank's shard) of an HF tensor of `shape`; None for a tensor the model skips."""
        if self.fp8 is not None and hf_name.rpartition(".")[2] in _ACTIVATION_SCALES:
            return None
        found = target(self.model, hf_name)
        if found is None:
            return None
        name, index = found
        if name not in self.params:
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in {file_name}: the "
                                 f"{self.model.spec.architecture} model has no such weight")
        shard = weight_shard(self.model, name, index)
        if tuple(shape) != shard.hf_shape:
            raise ModelLoadError(f"tensor {hf_name!r} in {file_name} has shape {tuple(shape)}, "
                                 f"but the model expects {shard.hf_shape}")
        module = self.model.get_submodule(name.rpartition(".")[0])
        experts = isinstance(module, Experts)
        self._covers[hf_name] = covered_names(module, name, index) if experts else [canonical_name(self.model, hf_name)]
        return name, shard

    def zeros(self, name: str) -> torch.Tensor:
        return torch.zeros(self.params[name].shape, dtype=self.dtype, device=self.device)

    def put(self, hf_name: str, name: str, shard: WeightShard, tensor: torch.Tensor) -> int:
        """This rank's part of HF tensor `hf_name` (on the device) into parameter `name`, in dtype (or in fp8 as
        stored, for an FP8 checkpoint's weights). Returns how many of the expected names it filled (a stacked expert
        tensor fills one per expert: the progress bar counts those)."""
        tensor = self._cast(hf_name, name, shard.assemble(tensor))
        rows = shard.dst_rows
        if rows is None and shard.dst_index is None:
            set_param(self.model, name, tensor)
        else:
            if name not in self._packed:
                self._packed[name] = torch.empty(self.params[name].shape, dtype=tensor.dtype, device=self.device)
            elif self._packed[name].dtype != tensor.dtype:
                raise ModelLoadError(f"tensor {hf_name!r} is {tensor.dtype}, but the other parts of {name!r} are "
                                     f"{self._packed[name].dtype}")
            index = (slice(rows[0], rows[1]),) if rows is not None else shard.dst_index
            self._packed[name][index].copy_(tensor)
        covered = self._covers.pop(hf_name, (hf_name,))
        self.loaded.update(covered)
        return len(covered)

    def _cast(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != FP8_DTYPE:
            return tensor.to(self.dtype)
        if self.fp8 is None or not name.endswith(".weight"):
            raise ModelLoadError(f"tensor {hf_name!r} is stored in {tensor.dtype} without a quantization_config "
                                 "that gives its scales")
        self.fp8_weights[hf_name] = name
        return tensor

    def finish(self, source) -> None:
        """Refuse a checkpoint that lacks a tensor (naming the first); then set the merged parameters."""
        missing = [n for n in self.expected if n not in self.loaded]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ModelLoadError(f"missing tensor {missing[0]!r}{more} in {source}")
        for name, tensor in self._packed.items():
            set_param(self.model, name, tensor)
        if self.scales is not None:
            self.scales.finish(self.fp8_weights, source)


__all__ = ["ParamWriter", "hf_names", "set_param", "target"]
