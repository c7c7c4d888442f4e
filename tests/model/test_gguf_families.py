"""GGUF files of the dense families, written here as llama.cpp's converter writes them: Gemma 2 / 3 (norms stored as
1 + w, soft-caps and window in the metadata, Gemma 3's linear scaling on its global layers), Phi-3 (fused attn_qkv
and ffn_up, partial rotary as rope.dimension_count, its window) and Mistral (a "llama" file, no window) load to
exactly the safetensors folder's weights and generate its tokens; what GGUF cannot carry is one-line refusals.

The tiny folders keep to what a GGUF states: no query_pre_attn_scalar (llama.cpp uses head_dim below 27B) and
Gemma 3's fixed layer pattern (every sixth layer global).
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import pytest
from gguf_files import quantized_copy, write_gguf

from nanoserve.model_files import ModelSpec, load_hf_config
from nanoserve.tiny import TINY_WINDOW, make_tiny_model
from tests.model.test_gguf import assert_one_line_error, assert_same_generations, assert_same_weights, load

Q8_0 = gguf.GGMLQuantizationType.Q8_0
FAMILIES = {"gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
            "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None)),
            "phi3": ("phi3", dict(sliding_window=TINY_WINDOW)),
            "mistral": ("mistral", dict(sliding_window=None))}


@pytest.fixture(scope="module")
def family_files(tmp_path_factory) -> dict[str, tuple]:
    """name → (tiny folder, the same model as an F32 GGUF file)."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for name, (arch, overrides) in FAMILIES.items():
        folder = make_tiny_model(root / name, arch, **overrides)
        out[name] = folder, write_gguf(folder, root / f"{name}.gguf")
    return out


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_family_gguf_loads_the_weights_and_spec_of_the_folder(name, family_files):
    folder, file = family_files[name]
    ours, theirs = load(file), load(folder)
    assert_same_weights(ours, theirs)  # Gemma: the file's 1 + w norms as the folder's; Phi-3: fused rows split
    want = theirs.spec
    # soft-caps, attention scale, window and layer types, linear RoPE scaling, partial rotary
    assert dataclasses.replace(ours.spec, rms_norm_eps=want.rms_norm_eps) == want


def test_mistral_gguf_is_a_llama_file_without_a_window(family_files):
    """llama.cpp writes Mistral as "llama" and states no window: full attention, as llama.cpp runs it."""
    folder, file = family_files["mistral"]
    ours, theirs = load(file), load(folder)
    assert_same_weights(ours, theirs)  # q/k rows un-permuted as for Llama
    assert ours.spec.architecture == "LlamaForCausalLM"
    assert [ours.spec.window(i) for i in range(ours.num_layers)] == [None] * ours.num_layers


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_gguf_generates_the_folder_tokens(name, family_files):
    """Past the window (prompt + 12 tokens > TINY_WINDOW): Gemma's and Phi-3's windows come from the metadata."""
    assert_same_generations(*family_files[name], max_tokens=12)


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_q8_0_family_gguf_loads_gguf_own_dequantized_values(name, family_files, tmp_path):
    folder, _ = family_files[name]
    file = write_gguf(folder, tmp_path / f"{name}.Q8_0.gguf", Q8_0)
    assert_same_weights(load(file), load(quantized_copy(folder, tmp_path / "reference", Q8_0)))


@pytest.mark.parametrize("arch,layers", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_attention_scale_is_llama_cpp_rule(arch, layers, family_files, tmp_path):
    """GGUF has no query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B models (by layer count)."""
    folder = shutil.copytree(family_files[arch][0], tmp_path / "big")
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_attention_heads=2)  # hidden / heads 32, head_dim 16
    config.pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(config))
    spec = ModelSpec.from_hf_config(load_hf_config(write_gguf(folder, tmp_path / "big.gguf", tensors={})))
    assert spec.attn_scale == 32 ** -0.5 and spec.head_dim == 16


def test_olmo2_gguf_is_refused_naming_its_architecture(tmp_path):
    folder = make_tiny_model(tmp_path / "olmo2", "olmo2")
    assert_one_line_error(write_gguf(folder, tmp_path / "olmo2.gguf"), "unsupported GGUF architecture 'olmo2'")


def test_phi3_longrope_gguf_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "phi3", "phi3", max_position_embeddings=8192,
                             rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.5,
                                              "original_max_position_embeddings": 2048,
                                              "short_factor": [1.0, 1.3, 2.0, 3.1],
                                              "long_factor": [2.0, 4.0, 8.0, 16.0]})
    assert_one_line_error(write_gguf(folder, tmp_path / "longrope.gguf"), "LongRoPE")
