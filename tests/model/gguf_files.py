"""Write a tiny HF model folder as a GGUF file the way llama.cpp's converter does, with gguf.GGUFWriter.

llama.cpp renames tensors (gguf's name table), permutes the q/k rows of llama-family models for its
interleaved RoPE, stacks a mixture of experts' per-expert matrices into one [E, rows, cols] tensor per projection,
keeps 1-D tensors (norms, biases) and the routers in F32 and stores the other matrices in the chosen type. The
loader must undo all of that; writing the files here, from weights the test also has as safetensors,
gives it something exact to be checked against.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

F32 = gguf.GGMLQuantizationType.F32
# HF model_type → GGUF architecture where the names differ (llama.cpp writes Mistral and Mixtral as "llama").
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "mistral": "llama",
             "gemma3_text": "gemma3"}
# Architecture keys llama.cpp's converter writes for some families only (GGUFWriter method → config field).
_FAMILY_KEYS = {"gemma2": {"add_attn_logit_softcapping": "attn_logit_softcapping",
                           "add_final_logit_softcapping": "final_logit_softcapping",
                           "add_sliding_window": "sliding_window"},
                "gemma3": {"add_final_logit_softcapping": "final_logit_softcapping",
                           "add_sliding_window": "sliding_window"},
                "phi3": {"add_sliding_window": "sliding_window",  # None is written as 0 (Phi-4: no window)
                         "add_rope_scaling_orig_ctx_len": "original_max_position_embeddings"}}
# GGUF architectures whose converter stores Gemma's (1 + w) norms as 1 + w (names ending in norm.weight).
_NORM_SHIFTED = ("gemma2", "gemma3")
# Matrices llama.cpp's converter always keeps in F32 (its tensor_force_quant list): the routers.
_F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
_F32_HF_MATRICES = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


def quantizable_types() -> list[gguf.GGMLQuantizationType]:
    """Every tensor type gguf can both quantize and dequantize in numpy (so a test can write it)."""
    probe = np.linspace(-1, 1, 256 * 2, dtype=np.float32).reshape(2, 256)
    types = []
    for qtype in gguf.GGMLQuantizationType:
        try:
            gguf.dequantize(gguf.quantize(probe, qtype), qtype)
        except (NotImplementedError, ValueError, AssertionError):
            continue
        types.append(qtype)
    return types


def write_gguf(model_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType = F32, arch: str | None = None,
               tensors: dict[str, np.ndarray | tuple] | None = None) -> Path:
    """model_dir (a tiny folder) as one GGUF file, matrices stored as `qtype`.

    arch overrides the file's architecture name; tensors (GGUF name → float array, or (raw bytes, type)) replace
    the folder's weights.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch or gguf_arch(config))
    _write_config(writer, config)
    _write_tokenizer(writer, model_dir)
    weights = tensors if tensors is not None else gguf_tensors(model_dir)
    for name, array in weights.items():
        if isinstance(array, tuple):  # bytes of a given type: the writer derives the shape from the byte shape
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        elif array.ndim >= 2 and qtype != F32 and not name.endswith(_F32_MATRICES):
            quantized = gguf.quantize(array, qtype)
            writer.add_tensor(name, quantized, raw_dtype=None if quantized.dtype == np.float16 else qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized_copy(model_dir: Path, out_dir: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """A copy of the folder whose matrices went through quantize → dequantize: what a GGUF of `qtype` holds.

    Quantization works on blocks inside a row, so it commutes with llama.cpp's q/k row permutation and with
    stacking the experts; the routers stay F32 as write_gguf keeps them.
    """
    import shutil

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    for name, t in tensors.items():
        if t.ndim >= 2 and not name.endswith(_F32_HF_MATRICES):
            tensors[name] = torch.from_numpy(gguf.dequantize(gguf.quantize(t.numpy(), qtype), qtype).copy())
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def gguf_arch(config: dict) -> str:
    return GGUF_ARCH.get(config["model_type"], config["model_type"])


def _write_config(writer: gguf.GGUFWriter, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers: the file's one RoPE base and scaling
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rotary = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(rotary * head_dim))
    writer.add_vocab_size(config["vocab_size"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "longrope":  # the factors themselves are tensors (gguf_tensors)
        writer.add_rope_scaling_attn_factors(_longrope_attn_factor(config, rope))
    for method, field in _FAMILY_KEYS.get(gguf_arch(config), {}).items():
        if config.get(field) is not None or method == "add_sliding_window":
            getattr(writer, method)(config.get(field) or 0)
    _write_moe_config(writer, config)


def _longrope_attn_factor(config: dict, rope: dict) -> float:
    """llama.cpp's Phi-3 converter: sqrt(1 + log(scale) / log(original length)) for a context scaled up."""
    original = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def _write_moe_config(writer: gguf.GGUFWriter, config: dict) -> None:
    """The expert keys llama.cpp's converter writes (TextModel: counts; Qwen2MoeModel: the expert sizes)."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """The byte-level BPE vocabulary, merges, special ids and chat template, as llama.cpp stores a gpt2 tokenizer."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)  # added_tokens_decoder: id → AddedToken
    generation = json.loads((Path(model_dir) / "generation_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(generation["eos_token_id"][0])
    writer.add_eot_token_id(generation["eos_token_id"][1])
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)


def gguf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """GGUF name → float array, as llama.cpp's convert_hf_to_gguf writes them: q/k rows permuted for llama-family
    files, each layer's experts stacked per projection (torch.stack over the expert number, its Qwen2MoeModel),
    Gemma's norms stored as 1 + w, Phi-3's fused qkv / gate-up kept fused (attn_qkv, ffn_up)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = gguf_arch(config)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    out, experts = {}, {}
    for hf_name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = hf_name.endswith("k_proj.weight")
            array = _llama_cpp_permute(array, config["num_key_value_heads" if kv else "num_attention_heads"])
        if arch in _NORM_SHIFTED and hf_name.endswith("norm.weight"):
            array = array + 1
        parts = hf_name.split(".")
        if "experts" in parts:  # prefix.experts.N.proj.weight → prefix.experts.proj.weight, expert N
            i = parts.index("experts")
            stacked = ".".join(parts[:i + 1] + parts[i + 2:])
            experts.setdefault(stacked, {})[int(parts[i + 1])] = array
            continue
        out[hf_name] = array
    out.update({name: np.stack([by_expert[e] for e in sorted(by_expert)]) for name, by_expert in experts.items()})
    gguf_names = {}
    for hf_name, array in out.items():
        module, _, leaf = hf_name.rpartition(".")
        gguf_module = name_map.get_name(module)
        if gguf_module is None:  # the converter's "Can not map tensor": the architecture has no such tensor
            raise ValueError(f"llama.cpp has no {arch} tensor for {hf_name!r}")
        gguf_names[f"{gguf_module}.{leaf}"] = array
    rope = config.get("rope_parameters") or {}
    if rope.get("long_factor"):  # Phi-3's LongRoPE factors, as its converter adds them
        gguf_names["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        gguf_names["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return gguf_names


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows go from HF's half-split to interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
