"""Loader: every broken folder is a ModelLoadError naming the problem; sharded, tied and dtype-cast loads work."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.model.loader import load_model
from nanoserve.model_files import ModelLoadError, eos_token_ids, load_hf_config, load_tokenizer, model_max_len

CPU = torch.device("cpu")


@pytest.fixture
def model_copy(tmp_path, tiny_model_dirs):
    """A private copy of the tiny llama folder that a test may break."""
    def make(arch: str = "llama") -> Path:
        dst = tmp_path / arch
        shutil.copytree(tiny_model_dirs[arch], dst)
        return dst
    return make


def load(d: Path, dtype: torch.dtype = torch.float32):
    return load_model(d, load_hf_config(d), dtype, CPU)


def edit_weights(d: Path, fn) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def edit_config(d: Path, fn) -> None:
    raw = json.loads((d / "config.json").read_text())
    fn(raw)
    (d / "config.json").write_text(json.dumps(raw))


# ---- config errors ----

def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(tmp_path / "no_such_model")


def test_missing_config(model_copy):
    d = model_copy()
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_config(d)


def test_invalid_config_json(model_copy):
    d = model_copy()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_hf_config(d)


def test_unsupported_architecture_names_the_supported_ones(model_copy):
    d = model_copy()
    edit_config(d, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM.*Qwen3"):
        load_hf_config(d)


def test_windows_load_and_an_unknown_activation_is_refused(model_copy):
    d = model_copy()
    edit_config(d, lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64))
    assert {a.sliding_window for a in load(d).attention_layers()} == {64}  # Mistral windows every layer
    edit_config(d, lambda c: c.update(sliding_window=None, hidden_act="gelu"))
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        load_hf_config(d)
    edit_config(d, lambda c: c.update(hidden_act="silu"))
    assert {a.sliding_window for a in load(d).attention_layers()} == {None}  # no window: the Llama shape


# ---- weight file errors ----

def test_missing_weights(model_copy):
    d = model_copy()
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load(d)


def test_only_pickle_weights_are_refused(model_copy):
    d = model_copy()
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(ModelLoadError, match=r"pickle weights \(pytorch_model\.bin\).*safetensors only"):
        load(d)


def test_missing_tensor_is_named(model_copy):
    d = model_copy()
    edit_weights(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load(d)


def test_untied_model_needs_lm_head(model_copy):
    d = model_copy()
    edit_weights(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="missing tensor 'lm_head.weight'"):
        load(d)


def test_extra_tensor_is_named(model_copy):
    d = model_copy()
    edit_weights(d, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight' in model"):
        load(d)


def test_harmless_extra_tensors_are_ignored(model_copy):
    d = model_copy()
    edit_weights(d, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load(d)


def test_misshaped_tensor_shows_both_shapes(model_copy):
    d = model_copy()
    edit_weights(d, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 63)}))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*\(128, 63\).*\(128, 64\)"):
        load(d)
    edit_weights(d, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64),
                                        "model.norm.weight": torch.ones(65)}))
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight'.*\(65,\).*\(64,\)"):
        load(d)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_file_is_named(model_copy, damage):
    d = model_copy()
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 8)
    with pytest.raises(ModelLoadError, match=r"cannot read weights file .*model\.safetensors"):
        load(d)


# ---- working loads ----

@torch.inference_mode()
def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dirs["qwen3"]
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, sharded / f)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()
    a, b = load(src), load(sharded)
    for (name, p), (name_b, q) in zip(a.named_parameters(), b.named_parameters()):
        assert name == name_b
        torch.testing.assert_close(p, q, atol=0, rtol=0)

    shard = sorted(set(index["weight_map"].values()))[1]
    (sharded / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"'{shard}' listed in model.safetensors.index.json is missing"):
        load(sharded)


@torch.inference_mode()
def test_tied_embeddings(model_copy):
    d = model_copy("qwen2")
    model = load(d)
    assert model.lm_head is None
    hidden = torch.randn(3, model.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)
    # A tied checkpoint that also stores lm_head.weight (some exporters do) loads; the embedding wins.
    edit_weights(d, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])}))
    torch.testing.assert_close(load(d).compute_logits(hidden), model.compute_logits(hidden))


@torch.inference_mode()
def test_merged_weights_are_hf_tensors_concatenated(tiny_model_dirs):
    d = tiny_model_dirs["qwen2"]
    hf = load_file(str(d / "model.safetensors"))
    layer = load(d).model.layers[1]
    p = "model.layers.1."
    qkv = [hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, torch.cat(qkv), atol=0, rtol=0)
    torch.testing.assert_close(layer.self_attn.qkv_proj.bias, torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_override(tiny_model_dirs, dtype):
    d = tiny_model_dirs["llama"]
    model = load(d, dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.model.rotary_emb.cos_sin_cache.dtype == dtype
    ref = load_file(str(d / "model.safetensors"))["model.embed_tokens.weight"]
    torch.testing.assert_close(model.model.embed_tokens.weight, ref.to(dtype), atol=0, rtol=0)


def test_unknown_load_format(tiny_model_dirs):
    d = tiny_model_dirs["llama"]
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model(d, load_hf_config(d), torch.float32, CPU, load_format="pt")


# ---- tokenizer, EOS, max length ----

def test_tokenizer_round_trips_and_has_a_chat_template(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = "Hello, world! Ünïcödé ✓ 你好 🙂\n\ttabs  and  spaces"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(tok.encode("The capital of France is Paris.", add_special_tokens=False)) <= 10
    assert max(ids) < load_hf_config(tiny_model_dir).vocab_size
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


def test_missing_tokenizer(model_copy, tmp_path):
    d = model_copy()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_tokenizer(d)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_eos_token_ids_sources_in_order(model_copy):
    d = model_copy()
    cfg = load_hf_config(d)
    tok = load_tokenizer(d)
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert eos_token_ids(d, cfg, tok) == [eos, im_end]  # generation_config.json lists both
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    assert eos_token_ids(d, cfg) == [im_end]
    (d / "generation_config.json").unlink()
    assert eos_token_ids(d, cfg) == [cfg.eos_token_id]
    cfg.eos_token_id = None
    assert eos_token_ids(d, cfg, tok) == [eos]
    assert eos_token_ids(d, cfg) == []


def test_model_max_len(tiny_model_dirs):
    assert model_max_len(load_hf_config(tiny_model_dirs["qwen3"])) == 2048


@pytest.mark.gpu
def test_load_to_gpu(tiny_model_dirs):
    from nanoserve.kernels.attention import select_backend

    d = tiny_model_dirs["qwen3"]
    model = load_model(d, load_hf_config(d), torch.bfloat16, torch.device("cuda"))
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert model.model.rotary_emb.cos_sin_cache.device.type == "cuda"
    assert {a.backend for a in model.attention_layers()} == {select_backend(torch.device("cuda"))}
    dummy = load_model("/nonexistent", load_hf_config(d), torch.bfloat16, torch.device("cuda"), load_format="dummy")
    assert {p.device.type for p in dummy.parameters()} == {"cuda"}
