"""Per-layer KV-cache scales of pre-quantized checkpoints: every name such checkpoints use (compressed-tensors,
ModelOpt, the older single kv_scale) loads as stored onto each layer's Attention (`checkpoint_kv_scales`), never as
an unexpected weight; a bad scale, a half pair, or a kv_cache_scheme nanoserve cannot use is one clear line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.model.communicator import TensorParallel
from nanoserve.model_files import ModelLoadError, checkpoint_quantization
from nanoserve.tiny import make_tiny_model
from tests.model.test_fp8_checkpoints import quantization_config, write_checkpoint
from tests.model.test_quantization import load

# naming variant → the tensors (after `model.layers.N.self_attn.`) that carry a layer's K and V scales
VARIANTS = {
    "self_attn": ("k_scale", "v_scale"),
    "attn": ("attn.k_scale", "attn.v_scale"),
    "modelopt": ("k_proj.k_scale", "v_proj.v_scale"),
    "output_scale": ("k_proj.output_scale", "v_proj.output_scale"),
    "kv_scale": ("kv_scale",),
}
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def layer_scales(i: int) -> tuple[float, float]:
    return 0.5 + i / 8, 0.25 + i / 16  # exact in fp32


def add_kv_scales(d: Path, names: tuple[str, ...], layers=None, value=None, quant: dict | None = None) -> None:
    """Add KV-cache scales to the checkpoint in folder d (per layer, a scalar or a 1-element tensor in turn; a single
    kv_scale gets the K value), and quant as its quantization_config."""
    tensors = load_file(str(d / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())
    for i in range(config["num_hidden_layers"]) if layers is None else layers:
        for name, scale in zip(names, layer_scales(i)):
            shape = () if i % 2 else (1,)
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.full(shape, scale if value is None else value)
    save_file(tensors, str(d / "model.safetensors"))
    if quant is not None:
        (d / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))


def copy(tiny_model_dirs, tmp_path) -> Path:
    d = tmp_path / "llama"
    shutil.copytree(tiny_model_dirs["llama"], d)
    return d


def loaded_scales(d: Path, **kw) -> list:
    return [getattr(attn, "checkpoint_kv_scales", None) for attn in load(d, **kw).attention_layers()]


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_naming_loads_the_scales_as_stored(variant, tiny_model_dirs, tmp_path):
    d = copy(tiny_model_dirs, tmp_path)
    add_kv_scales(d, VARIANTS[variant])
    got = loaded_scales(d)
    want = [(k, k if variant == "kv_scale" else v) for k, v in map(layer_scales, range(len(got)))]
    assert got == want


def test_a_multimodal_checkpoints_text_layers_take_theirs(tmp_path):
    """Gemma 3's multimodal checkpoint: the text model's names are renamed as its weights are; a vision tower's
    scales are skipped with the tower."""
    d = make_tiny_model(tmp_path / "mm", "gemma3_mm")
    tensors = load_file(str(d / "model.safetensors"))
    layers = json.loads((d / "config.json").read_text())["text_config"]["num_hidden_layers"]
    for i in range(layers):
        tensors[f"language_model.model.layers.{i}.self_attn.k_scale"] = torch.tensor(layer_scales(i)[0])
        tensors[f"language_model.model.layers.{i}.self_attn.v_scale"] = torch.tensor(layer_scales(i)[1])
    tensors["vision_tower.encoder.layers.0.self_attn.k_scale"] = torch.tensor(3.0)
    save_file(tensors, str(d / "model.safetensors"))
    assert loaded_scales(d) == [layer_scales(i) for i in range(layers)]


@pytest.mark.parametrize("rank", [0, 1])
def test_every_tensor_parallel_rank_takes_the_same_scales(rank, tiny_model_dirs, tmp_path):
    d = copy(tiny_model_dirs, tmp_path)
    add_kv_scales(d, VARIANTS["self_attn"])
    tp = TensorParallel(rank, 2, group=object())  # loading runs no collective
    assert loaded_scales(d, tp=tp) == [layer_scales(0), layer_scales(1)]


def test_a_checkpoint_without_scales_sets_none(tiny_model_dirs):
    assert loaded_scales(tiny_model_dirs["llama"]) == [None, None]


def test_an_fp8_checkpoint_with_a_kv_cache_scheme(tiny_model_dirs, tmp_path):
    """compressed-tensors FP8 weights with kv_cache_scheme and the scales as k_proj / v_proj output_scale (which the
    static activation scales beside them must not swallow)."""
    d = tmp_path / "fp8"
    write_checkpoint(tiny_model_dirs["llama"], d, "ct-channel")
    add_kv_scales(d, VARIANTS["output_scale"], quant=dict(quantization_config("ct-channel"), kv_cache_scheme=KV_SCHEME))
    assert loaded_scales(d) == [layer_scales(0), layer_scales(1)]


def test_a_kv_cache_scheme_alone_leaves_the_weights_unquantized(tiny_model_dirs, tmp_path):
    d = copy(tiny_model_dirs, tmp_path)
    add_kv_scales(d, VARIANTS["self_attn"], quant={"quant_method": "compressed-tensors", "format": "float-quantized",
                                                   "config_groups": {}, "kv_cache_scheme": KV_SCHEME})
    model = load(d)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert [attn.checkpoint_kv_scales for attn in model.attention_layers()] == [layer_scales(0), layer_scales(1)]


def one_line_error(d: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as e:
        load(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_scale_not_finite_and_positive_is_refused(value, tiny_model_dirs, tmp_path):
    d = copy(tiny_model_dirs, tmp_path)
    add_kv_scales(d, VARIANTS["attn"], layers=[1], value=value)
    one_line_error(d, r"KV-cache scale 'model\.layers\.1\.self_attn\.attn\.k_scale' .* must be finite and positive")


def test_bad_scale_tensors_are_one_line_errors(tiny_model_dirs, tmp_path):
    d = copy(tiny_model_dirs, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    save_file(dict(tensors, **{"model.layers.0.self_attn.k_scale": torch.ones(2)}), str(d / "model.safetensors"))
    one_line_error(d, r"'model\.layers\.0\.self_attn\.k_scale' .* has shape \(2,\); one value per layer")
    save_file(dict(tensors, **{"model.layers.0.self_attn.k_scale": torch.ones(1)}), str(d / "model.safetensors"))
    one_line_error(d, "has a K scale for 'model.layers.0.self_attn.attn' but no V scale")
    save_file(dict(tensors, **{"model.layers.7.self_attn.kv_scale": torch.ones(1)}), str(d / "model.safetensors"))
    one_line_error(d, r"unexpected tensor 'model\.layers\.7\.self_attn\.kv_scale'")
    save_file(dict(tensors, **{"model.layers.0.self_attn.kv_scale": torch.ones(1),
                               "model.layers.0.self_attn.v_scale": torch.full((1,), 2.0)}), str(d / "model.safetensors"))
    one_line_error(d, "two V scales, 1.0 and 2.0")


def test_a_kv_cache_scheme_without_scale_tensors_is_refused(tiny_model_dirs, tmp_path):
    d = tmp_path / "fp8"
    write_checkpoint(tiny_model_dirs["llama"], d, "ct-tensor")
    add_kv_scales(d, (), quant=dict(quantization_config("ct-tensor"), kv_cache_scheme=KV_SCHEME))
    one_line_error(d, "kv_cache_scheme is set, but the checkpoint has no k_scale / v_scale tensors")


@pytest.mark.parametrize("change", [{"num_bits": 4, "type": "int"}, {"strategy": "channel"}, {"dynamic": True},
                                    {"symmetric": False}])
def test_kv_cache_schemes_other_than_fp8_per_tensor_are_refused(change, tiny_model_dirs, tmp_path):
    quant = dict(quantization_config("ct-tensor"), kv_cache_scheme=dict(KV_SCHEME, **change))
    with pytest.raises(ModelLoadError, match="nanoserve loads static symmetric 8-bit float KV-cache scales per "
                                             "tensor") as e:
        checkpoint_quantization(quant, "config.json")
    assert "\n" not in str(e.value)
    d = copy(tiny_model_dirs, tmp_path)
    add_kv_scales(d, VARIANTS["self_attn"], quant=quant)
    one_line_error(d, "kv_cache_scheme is")
