"""What both weight readers share (safetensors in model/loader.py, GGUF in model/gguf.py): Hugging Face tensor
names ↔ our parameters, and writing this rank's part of each tensor into them.

Our parameters follow HF's names except the merged ones (qkv_proj, gate_up_proj: PACKED_MODULES); a merged parameter
is filled shard by shard in a buffer and set once every part is in. How each family's checkpoint names differ from
ours is one table, CHECKPOINT_NAMES.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.kernels.fp8 import FP8_DTYPE
from nanoserve.model.layers import RMSNorm, WeightShard, weight_shard
from nanoserve.model.moe import Experts, covered_names, expert_target
from nanoserve.model.quantization import CheckpointKVScales, Fp8Scales, kv_scale_target
from nanoserve.model_files import Fp8Checkpoint, ModelLoadError

# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# HF module name → (our merged module, index of the HF tensor in it); layers.weight_shard places it.
PACKED_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class CheckpointNames:
    """How one family's checkpoint names its tensors, where that differs from ours.

    renames: (checkpoint name part, ours), replaced once each (a multimodal checkpoint's text model prefix, Mixtral's
    block_sparse_moe). skipped: name prefixes of tensors we do not run (a vision tower). fused: a checkpoint module
    holding several HF modules' rows stacked in order (Phi-3's qkv_proj, gate_up_proj): each part is placed, and
    sharded under tensor parallelism, on its own, as if the checkpoint held them apart."""

    renames: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()


_GEMMA3_MULTIMODAL = CheckpointNames(
    renames=(("model.language_model.", "model."), ("language_model.model.", "model."),  # transformers 5, 4
             ("language_model.lm_head.", "lm_head.")),
    skipped=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."))
CHECKPOINT_NAMES = {
    "MixtralForCausalLM": CheckpointNames(renames=((".block_sparse_moe.", ".mlp."),)),
    "Phi3ForCausalLM": CheckpointNames(fused=(("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                              ("gate_up_proj", ("gate_proj", "up_proj")))),
    "Gemma3ForConditionalGeneration": _GEMMA3_MULTIMODAL,
}
_PLAIN = CheckpointNames()


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor, or one part of a fused one: its HF name, shape, and rows of the stored tensor (None: all)."""

    hf_name: str
    shape: tuple[int, ...]
    rows: slice | None = None

    def index(self, shard: WeightShard) -> tuple[slice, ...] | None:
        """What to read of the stored tensor for `shard` of this piece (None: all of it)."""
        if self.rows is None:
            return shard.src
        src = shard.src or (slice(None),)
        first = src[0]
        start = self.rows.start + (first.start or 0)
        stop = self.rows.start + (first.stop if first.stop is not None else self.shape[0])
        return (slice(start, stop),) + tuple(src[1:])


def names_of(model) -> CheckpointNames:
    return CHECKPOINT_NAMES.get(model.spec.architecture, _PLAIN)


def pieces(model, hf_name: str, shape: tuple[int, ...]) -> list[Piece]:
    """A checkpoint tensor as the tensors our tables know: itself, or a fused tensor's parts (rows in order)."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, last = module.rpartition(".")
    parts = dict(names_of(model).fused).get(last)
    if parts is None:
        return [Piece(hf_name, tuple(shape))]
    spec = model.spec
    sizes = {"q_proj": spec.num_heads * spec.head_dim, "k_proj": spec.num_kv_heads * spec.head_dim,
             "v_proj": spec.num_kv_heads * spec.head_dim, "gate_proj": spec.intermediate_size,
             "up_proj": spec.intermediate_size}
    if shape[0] != sum(sizes[p] for p in parts):
        raise ModelLoadError(f"tensor {hf_name!r} has {shape[0]} rows, but {' + '.join(parts)} have "
                             f"{sum(sizes[p] for p in parts)}")
    out, start = [], 0
    for part in parts:
        rows = slice(start, start + sizes[part])
        out.append(Piece(f"{parent}.{part}.{leaf}", (sizes[part],) + tuple(shape[1:]), rows))
        start = rows.stop
    return out
# FP8 checkpoints' scales for static activation quantization: activations stay in the serving dtype or are quantized
# per token where they are used. (Their KV-cache scales go to the attention layers: CheckpointKVScales.)
_ACTIVATION_SCALES = ("input_scale", "output_scale", "q_scale")


def target(model, hf_name: str) -> tuple[str, object] | None:
    """HF tensor name → (our parameter, index of the HF tensor inside a merged or stacked weight or None); None to
    skip it."""
    if hf_name.endswith(_IGNORED_SUFFIXES) or hf_name.startswith(names_of(model).skipped):
        return None
    hf_name = canonical_name(model, hf_name)
    if hf_name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None  # tied: the embedding is the output projection
    parts = hf_name.split(".")
    if model.spec.moe is not None and "experts" in parts:
        return expert_target(parts) or (hf_name, None)
    if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
        merged, index = PACKED_MODULES[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), index
    return hf_name, None


def canonical_name(model, hf_name: str) -> str:
    """The name our tables know a checkpoint tensor by (CHECKPOINT_NAMES' renames: Mixtral's `block_sparse_moe` is
    the `mlp` of the others, a multimodal checkpoint's text model is the `model`)."""
    for old, new in names_of(model).renames:
        hf_name = hf_name.replace(old, new, 1)
    return hf_name


def hf_names(model, params: dict[str, nn.Parameter]) -> list[str]:
    """The HF tensor names a complete checkpoint must contain for these parameters."""
    unpacked: dict[str, list[str]] = {}
    for hf_module, (merged, shard) in PACKED_MODULES.items():
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
    FP8 checkpoint (fp8) its fp8 weights stay fp8 and their scales go to the layers' weight_scale. Per-layer KV-cache
    scales go to the attention layers (kv_cache_scheme: the config declares them, so they must be there)."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device, fp8: Fp8Checkpoint | None = None,
                 kv_cache_scheme: bool = False):
        self.model, self.dtype, self.device = model, dtype, device
        self.params = dict(model.named_parameters())
        self.expected = hf_names(model, self.params)
        self.loaded: set[str] = set()
        self._packed: dict[str, torch.Tensor] = {}  # merged params being filled shard by shard
        self.fp8 = fp8
        self.scales = Fp8Scales(model, fp8, device) if fp8 is not None else None
        self.kv_scales, self.kv_cache_scheme = CheckpointKVScales(model), kv_cache_scheme
        self.fp8_weights: dict[str, str] = {}  # HF weights stored in fp8 → their parameter
        self._covers: dict[str, list[str]] = {}  # a stacked expert tensor → the per-expert names it fills

    def is_scale(self, hf_name: str) -> bool:
        """Whether a tensor is an FP8 checkpoint's weight scales or a layer's KV-cache scale (then put_scale takes it,
        whole)."""
        if self._kv_scale_name(hf_name) is not None:
            return True
        return self.fp8 is not None and hf_name.rpartition(".")[2] == self.fp8.scale_name

    def put_scale(self, hf_name: str, file_name: str, scale: torch.Tensor) -> None:
        kv_name = self._kv_scale_name(hf_name)
        if kv_name is not None:
            self.kv_scales.add(kv_name, file_name, scale)
            return
        weight = hf_name.rpartition(".")[0] + ".weight"
        found = target(self.model, weight)
        if found is None or found[0] not in self.params:
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in {file_name}: the "
                                 f"{self.model.spec.architecture} model has no weight {weight!r} to scale")
        name, index = found
        self.scales.add(name, weight_shard(self.model, name, index), scale, hf_name)

    def _kv_scale_name(self, hf_name: str) -> str | None:
        """The name our tables know a layer's KV-cache scale by; None for another tensor (or one of a part the model
        skips, a vision tower's)."""
        if hf_name.startswith(names_of(self.model).skipped):
            return None
        name = canonical_name(self.model, hf_name)
        return name if kv_scale_target(name) is not None else None

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
            offset = self.model.spec.family.norm_offset
            if offset and isinstance(self.model.get_submodule(name.rpartition(".")[0]), RMSNorm):
                tensor = tensor.float() + offset  # Gemma's (1 + w), summed in fp32 as HF does
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
        self.kv_scales.finish(self.kv_cache_scheme, source)


__all__ = ["CHECKPOINT_NAMES", "CheckpointNames", "PACKED_MODULES", "ParamWriter", "Piece", "hf_names", "pieces",
           "set_param", "target"]
