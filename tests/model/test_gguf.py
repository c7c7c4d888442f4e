"""GGUF loading: tiny files written here with gguf.GGUFWriter load to exactly the weights of the same model's
safetensors (every type gguf can write), broken files are one-line ModelLoadErrors, and the real SmolLM2 file
loads with transformers' config and tokenizer."""
from __future__ import annotations

import dataclasses
import os
import time

import gguf
import numpy as np
import pytest
import torch
from gguf_files import F32, quantizable_types, quantized_copy, write_gguf

from nanoserve import LLM, SamplingParams
from nanoserve.model.loader import load_model
from nanoserve.model_files import ModelLoadError, eos_token_ids, load_hf_config, load_tokenizer, model_max_len
from nanoserve.tiny import make_tiny_model

CPU = torch.device("cpu")
TINY_OVERRIDES = {"llama": {"rope_scaling": None}}  # GGUF has no llama3 RoPE scaling keys; transformers reads none


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory) -> dict[str, tuple]:
    """arch → (tiny folder, the same model as an F32 GGUF file)."""
    root = tmp_path_factory.mktemp("gguf")
    pairs = {}
    for arch in ("llama", "qwen2", "qwen3"):
        folder = make_tiny_model(root / arch, arch, **TINY_OVERRIDES.get(arch, {}))
        pairs[arch] = folder, write_gguf(folder, root / f"{arch}.gguf")
    return pairs


def load(path, dtype=torch.float32):
    return load_model(path, load_hf_config(path), dtype, CPU)


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_loads_the_weights_and_config_of_the_safetensors_model(arch, tiny_pairs):
    folder, file = tiny_pairs[arch]
    ours, theirs = load(file), load(folder)
    assert_same_weights(ours, theirs)  # llama: llama.cpp's q/k row permutation undone exactly
    spec, want = ours.spec, theirs.spec
    assert spec.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # GGUF stores it as float32
    assert dataclasses.replace(spec, rms_norm_eps=want.rms_norm_eps) == want  # head_dim (qwen3), bias, tying
    assert model_max_len(load_hf_config(file)) == 2048


def assert_same_generations(folder, file, max_tokens: int, **options) -> None:
    """Through LLM on the CPU: the same greedy tokens and the same top logprobs from the file as from the folder."""
    options = dict(device="cpu", max_model_len=128, show_progress=False, **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 17, 230, 9], [100, 3, 44, 45, 46, 200, 7]]
    want = LLM(str(folder), **options).generate(prompts, params, use_tqdm=False)
    got = LLM(str(file), **options).generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for g_step, w_step in zip(g.logprobs, w.logprobs):
            assert g_step.keys() == w_step.keys()
            assert np.allclose(list(g_step.values()), list(w_step.values()), atol=1e-4)


def test_gguf_engine_matches_the_folder_engine_token_for_token(tiny_pairs):
    assert_same_generations(*tiny_pairs["qwen3"], max_tokens=12)


def test_tokenizer_chat_template_and_stop_ids_come_from_the_file(tiny_pairs):
    folder, file = tiny_pairs["qwen2"]
    ours, theirs = load_tokenizer(file), load_tokenizer(folder)
    text = "Hello, world! The capital of France is Paris."
    assert ours.encode(text) == theirs.encode(text)
    assert ours.chat_template == theirs.chat_template
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    # EOS plus the end-of-turn id the file names: what generation_config.json lists for the folder
    assert eos_token_ids(file, load_hf_config(file), ours) == eos_token_ids(folder, load_hf_config(folder), theirs)


@pytest.mark.parametrize("qtype", quantizable_types(), ids=lambda q: q.name)
def test_every_writable_quant_type_dequantizes_to_gguf_own_values(qtype, tmp_path):
    """Matrices stored as qtype load as gguf.dequantize(gguf.quantize(w)): the values the file holds."""
    folder = make_tiny_model(tmp_path / "llama", "llama", rope_scaling=None, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    file = write_gguf(folder, tmp_path / f"{qtype.name}.gguf", qtype)
    assert_same_weights(load(file), load(quantized_copy(folder, tmp_path / "reference", qtype)))


def test_gguf_loads_to_the_serving_dtype(tiny_pairs):
    folder, file = tiny_pairs["llama"]
    model = load(file, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_same_weights(model, load(folder, torch.bfloat16))


@pytest.mark.gpu
def test_gguf_loads_straight_to_the_gpu(tiny_pairs):
    folder, file = tiny_pairs["qwen2"]
    cuda = torch.device("cuda")
    model = load_model(file, load_hf_config(file), torch.bfloat16, cuda)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert_same_weights(model, load_model(folder, load_hf_config(folder), torch.bfloat16, cuda))


# ---- broken files: one line naming the problem ----

def assert_one_line_error(path, match: str):
    with pytest.raises(ModelLoadError, match=match) as err:
        load_hf_config(path)
    message = str(err.value)
    assert "\n" not in message and path.name in message, message


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a GGUF file\n")
    assert_one_line_error(bad, "not a GGUF file")
    assert_one_line_error(tmp_path / "missing.gguf", "does not exist")


@pytest.mark.parametrize("keep", [10, 300, 0.5, -8], ids=["header", "metadata", "tensors", "last-bytes"])
def test_truncated_file(keep, tiny_pairs, tmp_path):
    data = tiny_pairs["llama"][1].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    assert_one_line_error(cut, "truncated or corrupt")


def test_unsupported_tensor_type(tiny_pairs, tmp_path):
    folder, file = tiny_pairs["llama"]
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(file)).tensors}
    rows, cols = tensors["blk.0.attn_q.weight"].shape
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's intermediate type: gguf cannot dequantize it
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    tensors["blk.0.attn_q.weight"] = (np.zeros((rows, cols // block * size), dtype=np.uint8), q8_1)
    odd = write_gguf(folder, tmp_path / "q8_1.gguf", tensors=tensors)
    config = load_hf_config(odd)  # the metadata is fine; one tensor is not
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_q.weight' is stored as Q8_1.*cannot dequantize") as err:
        load_model(odd, config, torch.float32, CPU)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["mamba"])
def test_unsupported_architecture(arch, tiny_pairs, tmp_path):
    file = write_gguf(tiny_pairs["llama"][0], tmp_path / f"{arch}.gguf", arch=arch)
    assert_one_line_error(file, f"unsupported GGUF architecture '{arch}'.*llama, qwen2, qwen3")


def test_unexpected_tensor_is_named(tiny_pairs, tmp_path):
    folder, file = tiny_pairs["llama"]
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(file)).tensors}
    tensors["blk.0.attn_q.bias"] = np.zeros(tensors["blk.0.attn_q.weight"].shape[0], dtype=np.float32)
    extra = write_gguf(folder, tmp_path / "extra.gguf", tensors=tensors)
    with pytest.raises(ModelLoadError, match="unexpected tensor 'blk.0.attn_q.bias'"):
        load(extra)


def test_missing_tensor_is_named(tiny_pairs, tmp_path):
    folder, file = tiny_pairs["llama"]
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(file)).tensors if t.name != "output_norm.weight"}
    with pytest.raises(ModelLoadError, match="missing tensor 'model.norm.weight'"):
        load(write_gguf(folder, tmp_path / "short.gguf", tensors=tensors))


def test_dummy_weights_from_a_gguf_config(tiny_pairs):
    file = tiny_pairs["qwen3"][1]
    model = load_model(file, load_hf_config(file), torch.float32, CPU, load_format="dummy")
    assert model.spec.head_dim == 32


# ---- the real file ----

def test_real_smollm2_config_tokenizer_and_load_time(smollm2_gguf):
    from transformers import AutoConfig, AutoTokenizer

    start = time.perf_counter()
    config = load_hf_config(smollm2_gguf)
    tokenizer = load_tokenizer(smollm2_gguf)
    model = load_model(smollm2_gguf, config, torch.float32, CPU)
    seconds = time.perf_counter() - start
    folder, name = os.path.split(smollm2_gguf)
    want = AutoConfig.from_pretrained(folder, gguf_file=name)
    assert (model.num_layers, model.spec.hidden_size, model.spec.num_kv_heads) == (30, 576, 3)
    assert model.spec.tie_word_embeddings and config.to_dict() == want.to_dict()
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode("The capital of France is") == ref_tok.encode("The capital of France is")
    assert tokenizer.eos_token == "<|im_end|>" and eos_token_ids(smollm2_gguf, config, tokenizer) == [2]
    # Reported, not asserted (timing belongs in benchmarks/cpu.py, which records it).
    print(f"SmolLM2 Q4_1 GGUF: config + tokenizer + dequantized weights in {seconds:.2f} s")
