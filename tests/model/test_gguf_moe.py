"""Mixture-of-experts GGUF files (qwen2moe, qwen3moe), written here as llama.cpp's converter writes them (experts
stacked per projection, routers in F32): F32 files load to exactly the safetensors weights and the same greedy
tokens, Q8_0 files to gguf's dequantized values and transformers' logits on the same file; the expert sizes
transformers' GGUF mapping skips come from the metadata; Mixtral (a llama-architecture file with experts) is a
one-line refusal."""
from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf_files import gguf_tensors, quantized_copy, write_gguf

from nanoserve.model.communicator import TensorParallel
from nanoserve.model.loader import load_model
from nanoserve.model_files import ModelLoadError, load_hf_config
from nanoserve.tiny import make_tiny_model
from tests.model.test_gguf import assert_same_generations, assert_same_weights, load
from tests.model.test_llama import TOL, PagedKV, hf_logits, prefill_batch, random_seqs

CPU = torch.device("cpu")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
# llama.cpp's qwen3moe has no dense layers (its tensor table has no ffn_gate/ffn_up/ffn_down), so the tiny Qwen3-MoE
# written to GGUF has experts in every layer. The tiny sizes (hidden 64, experts' 32, shared 96) are whole Q8_0 blocks.
OVERRIDES = {"qwen3_moe": {"mlp_only_layers": []}, "qwen2_moe": {}}
ARCHS = tuple(OVERRIDES)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[str, tuple]:
    """arch → (tiny folder, the same model as an F32 GGUF, as a Q8_0 GGUF)."""
    root = tmp_path_factory.mktemp("gguf_moe")
    out = {}
    for arch, overrides in OVERRIDES.items():
        folder = make_tiny_model(root / arch, arch, **overrides)
        out[arch] = (folder, write_gguf(folder, root / f"{arch}.gguf"),
                     write_gguf(folder, root / f"{arch}.Q8_0.gguf", Q8_0))
    return out


def squeezed_copy(folder, out, qtype=gguf.GGMLQuantizationType.F32):
    """The file as older llama.cpp converters wrote it: every tensor squeezed, so Qwen2-MoE's shared-expert gate
    [1, H] is stored as [H] (the layout transformers' processor expects)."""
    return write_gguf(folder, out, qtype, tensors={n: a.squeeze() for n, a in gguf_tensors(folder).items()})


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_loads_the_weights_and_shape_of_the_safetensors_model(arch, moe_files):
    folder, file, _ = moe_files[arch]
    ours, theirs = load(file), load(folder)
    assert_same_weights(ours, theirs)  # experts un-stacked into gate_up_proj / down_proj, routers, shared expert
    spec, want = ours.spec, theirs.spec
    assert spec.moe is not None and spec.moe.intermediate_size == 32
    assert dataclasses.replace(spec, rms_norm_eps=want.rms_norm_eps) == want  # experts, top-k, sizes, renormalize


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_loads_gguf_own_dequantized_values(arch, moe_files, tmp_path):
    folder, _, file = moe_files[arch]
    assert_same_weights(load(file), load(quantized_copy(folder, tmp_path / "reference", Q8_0)))


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_q8_0_gguf_logits_match_transformers_loading_the_same_file(arch, moe_files, tmp_path):
    """transformers reads these weights too, given the config we read from the file (its own GGUF config keeps the
    config class's expert sizes) and, for Qwen2-MoE, the squeezed shared-expert gate its processor expects."""
    from transformers import AutoModelForCausalLM

    file = squeezed_copy(moe_files[arch][0], tmp_path / f"{arch}.Q8_0.gguf", Q8_0)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name, config=load_hf_config(file),
                                              dtype=torch.float32).eval()
    model = load(file)
    prompt_lens = [1, 4, 9]
    seqs = random_seqs(prompt_lens, model.vocab_size, seed=3)
    tables: list[list[int]] = [[] for _ in seqs]
    ids, pos, meta = prefill_batch(PagedKV(model, num_blocks=32, block_size=4), tables, seqs, [0] * len(seqs))
    logits = model.compute_logits(model(ids, pos, meta))
    for rows, seq in zip(logits.split(prompt_lens), seqs):
        torch.testing.assert_close(rows, hf_logits(hf, seq), **TOL)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_read_the_same_expert_columns_as_from_the_folder(rank, moe_files):
    folder, file, _ = moe_files["qwen2_moe"]
    a, b = (load_model(p, load_hf_config(p), torch.float32, CPU, tp=TensorParallel(rank, 2, group=object()))
            for p in (file, folder))
    assert a.model.layers[0].mlp.experts.down_proj.shape[2] == 16  # half of each expert's 32 columns
    assert_same_weights(a, b)


def test_shared_expert_gate_loads_from_either_layout(moe_files, tmp_path):
    folder, file, _ = moe_files["qwen2_moe"]
    old = squeezed_copy(folder, tmp_path / "squeezed.gguf")
    shapes = {t.name: tuple(t.data.shape) for t in gguf.GGUFReader(str(old)).tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
    assert_same_weights(load(old), load(file))


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_engine_matches_the_folder_engine_token_for_token(arch, moe_files):
    folder, file, _ = moe_files[arch]
    assert_same_generations(folder, file, 10, dtype="float32")


def test_expert_sizes_fall_back_as_llama_cpp_does(tmp_path):
    """A file without expert_feed_forward_length / expert_shared_feed_forward_length (Qwen1.5-MoE's early
    conversions): the experts' size is feed_forward_length / experts used, the shared expert's feed_forward_length."""
    folder = make_tiny_model(tmp_path / "full", "qwen2_moe", intermediate_size=64, shared_expert_intermediate_size=64)
    bare = shutil.copytree(folder, tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    del config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    (bare / "config.json").write_text(json.dumps(config))
    file = write_gguf(bare, tmp_path / "bare.gguf")
    assert not any("expert_feed_forward" in key or "expert_shared" in key for key in gguf.GGUFReader(str(file)).fields)
    loaded = load_hf_config(file)
    assert (loaded.moe_intermediate_size, loaded.shared_expert_intermediate_size) == (32, 64)
    assert_same_weights(load(file), load(folder))


def test_a_missing_expert_projection_is_named(moe_files, tmp_path):
    folder, file, _ = moe_files["qwen3_moe"]
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(file)).tensors
               if t.name != "blk.1.ffn_up_exps.weight"}
    short = write_gguf(folder, tmp_path / "short.gguf", tensors=tensors)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight' "
                                             r"\(and 15 more\)"):
        load(short)


def test_mixtral_gguf_is_a_one_line_refusal(tmp_path):
    """llama.cpp writes Mixtral as a llama file with llama.expert_count; transformers builds a dense LlamaConfig
    from it (no experts), so it is refused before any weight is read."""
    folder = make_tiny_model(tmp_path / "mixtral", "mixtral")
    file = write_gguf(folder, tmp_path / "mixtral.gguf")
    assert gguf.GGUFReader(str(file)).fields["llama.expert_count"].contents() == 8
    with pytest.raises(ModelLoadError, match="Mixtral GGUF files .* are not supported") as err:
        load_hf_config(file)
    assert "\n" not in str(err.value) and file.name in str(err.value)
