"""Tiny random Llama / Qwen2 / Qwen3 checkpoints, their mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE) and the
other dense families (Gemma 2, Gemma 3 text and multimodal, Mistral, Phi-3, OLMo-2) in Hugging Face format, built
offline in about a second.

Tests and demos need a real model folder (config.json, model.safetensors, a working tokenizer with a chat
template, generation_config.json) without downloading anything. The weights are random but large enough
that greedy decoding wanders instead of repeating one token, so engine-vs-transformers comparisons mean something.
"""
from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where weights are made: the CLI reads ARCHS without it
    import torch

ARCHS = ("llama", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
FAMILY_ARCHS = ("gemma2", "gemma3", "gemma3_mm", "mistral", "phi3", "olmo2")
ALL_ARCHS = ARCHS + MOE_ARCHS + FAMILY_ARCHS
TINY_WINDOW = 10  # the windowed families' sliding window: a few blocks of a test engine, never a multiple of them
# The families' shapes: windows on some layers (Gemma's layer_types), Gemma 3's local / global RoPE (linear scaling
# on the global layers, as Gemma 3 4B), a softmax scale that is not head_dim's, soft-caps low enough to bite on
# these logits, Phi-3's partial rotary. gemma3_mm is Gemma3ForConditionalGeneration: this text model and a tiny
# vision tower whose weights we skip.
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
_FAMILY_CONFIGS = {
    "gemma2": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
                   attn_logit_softcapping=20.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True, architectures=["Gemma2ForCausalLM"]),
    "gemma3": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters=_GEMMA3_ROPE, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                   architectures=["Gemma3ForCausalLM"]),
    "mistral": dict(sliding_window=TINY_WINDOW, tie_word_embeddings=False, architectures=["MistralForCausalLM"]),
    "phi3": dict(partial_rotary_factor=0.5, tie_word_embeddings=False, original_max_position_embeddings=2048,
                 architectures=["Phi3ForCausalLM"]),
    "olmo2": dict(tie_word_embeddings=False, architectures=["Olmo2ForCausalLM"]),
}
_FAMILY_CONFIGS["gemma3_mm"] = _FAMILY_CONFIGS["gemma3"]
# Which RMSNorms a layer has (model_files.Family.norms) and the q/k norm, for the weights written.
_SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_LAYER_NORMS = {"gemma2": _SANDWICH, "gemma3": _SANDWICH, "gemma3_mm": _SANDWICH,
                "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm")}
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "gemma3_mm": "head", "olmo2": "projection"}
_GEMMA = ("gemma2", "gemma3", "gemma3_mm")
# The MoE shapes: several experts a token, a dense layer among the sparse ones (Qwen3-MoE's mlp_only_layers), no
# renormalization of the top-k weights (Qwen2-MoE's default) and a gated shared expert.
_MOE_CONFIGS = {
    "qwen3_moe": dict(num_hidden_layers=3, head_dim=32, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                      tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"]),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=None,
                    tie_word_embeddings=False, architectures=["MixtralForCausalLM"]),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=96, norm_topk_prob=False, tie_word_embeddings=False,
                      architectures=["Qwen2MoeForCausalLM"]),
}

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, BOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tokenizer's BPE merges, so common English words become one or two tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
Once upon a time there was a small engine that served language models to many people at once.
It kept a cache of keys and values in blocks, and it never lost a request, even when memory ran short.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.
The capital of France is Paris. The capital of Japan is Tokyo. Water boils at one hundred degrees.
Write a short poem about the sea, the wind, the rain and the mountains in the north.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text, as do dates, prices and times of day.
She said that they would go to the market in the morning and come back before the evening.
A good test checks one thing, fails when that thing breaks, and runs fast enough to run often.
Please explain why the sky is blue, why the grass is green, and why the night is dark.
In the beginning the program reads the configuration, loads the weights, and warms up the device.
Then it waits for requests, schedules them in batches, and streams the generated tokens back.
The students asked the teacher a question about history, science, music and the stars above.
Every morning the baker makes bread, and every evening the children eat it with butter and honey.
"""


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random model of `arch` (ALL_ARCHS) to out_dir and return the folder.

    llama: Llama 3.1-style rope_scaling ("llama3"), untied lm_head. qwen2: qkv bias, tied embeddings.
    qwen3: per-head q/k RMSNorm, head_dim != hidden_size / num_heads. The MoE archs store their experts per expert,
    as published (Mixtral under block_sparse_moe with w1/w3/w2). Phi-3 stores fused qkv_proj / gate_up_proj, Gemma
    the w of its (1 + w) norms. config_overrides replace config fields (of the text_config for gemma3_mm).
    """
    if arch not in ALL_ARCHS:
        raise ValueError(f"arch must be one of {ALL_ARCHS}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    written = [Path(p) for p in tokenizer.save_pretrained(str(out))]
    config = _build_config(arch, len(tokenizer), tokenizer, config_overrides)
    weights = _random_weights(config, arch, seed)
    if arch == "gemma3_mm":
        _save_multimodal(config, weights, out, tokenizer)
    else:
        from safetensors.torch import save_file

        config.save_pretrained(str(out))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)]
    generation_config = {"bos_token_id": config.bos_token_id, "eos_token_id": eos_ids, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    written += [out / "config.json", out / "model.safetensors", out / "generation_config.json"]
    _make_readable(out, written)
    return out


def _save_multimodal(text_config, weights: dict, out: Path, tokenizer) -> None:
    """A Gemma3ForConditionalGeneration checkpoint saved by transformers itself (its own tensor names): our text
    weights in its language model, a tiny random SigLIP vision tower and projector beside them."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text_config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          architectures=["Gemma3ForConditionalGeneration"], torch_dtype="float32",
                          bos_token_id=text_config.bos_token_id, eos_token_id=text_config.eos_token_id,
                          pad_token_id=text_config.pad_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(k.startswith("model.language_model.") for k in missing):
        raise RuntimeError(f"tiny gemma3_mm: text weights do not fit ({unexpected or missing})")
    model.save_pretrained(str(out))


def _make_readable(folder: Path, files: list[Path]) -> None:
    """0755 / 0644: safetensors writes through a private temp file (0600), but a model folder is for sharing."""
    folder.chmod(0o755)
    for path in files:
        if path.is_file():
            path.chmod(0o644)


def _build_tokenizer():
    """Byte-level BPE trained on _CORPUS: any text round-trips (bytes fall back to single-byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
                                   model_max_length=2048)


def _build_config(arch: str, vocab_size: int, tokenizer, overrides: dict):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Olmo2Config, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=_INIT_STD,
                  bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
                  eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
                  pad_token_id=tokenizer.convert_tokens_to_ids(EOS), torch_dtype="float32")
    if arch == "llama":
        # original_max_position_embeddings 256 puts the 8 frequencies of head_dim 16 in all three llama3 bands.
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}
        kwargs = dict(common, rope_scaling=rope, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
        kwargs.update(overrides)
        return LlamaConfig(**kwargs)
    if arch in _MOE_CONFIGS:
        kwargs = dict(common, **_MOE_CONFIGS[arch])
        kwargs.update(overrides)
        return {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig}[arch](**kwargs)
    if arch in _FAMILY_CONFIGS:
        kwargs = dict(common, **_FAMILY_CONFIGS[arch])
        if arch in ("gemma3", "gemma3_mm", "phi3"):
            kwargs.pop("rope_theta")  # Gemma 3: per layer type; Phi-3: in its rope_parameters
        kwargs.update(overrides)
        classes = {"gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "gemma3_mm": Gemma3TextConfig,
                   "mistral": MistralConfig, "phi3": Phi3Config, "olmo2": Olmo2Config}
        return classes[arch](**kwargs)
    if arch == "qwen2":
        kwargs = dict(common, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
        kwargs.update(overrides)
        return Qwen2Config(**kwargs)
    kwargs = dict(common, head_dim=32, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


# Standard deviation of the random matrices. Llama-style inits (0.02) give a near-constant greedy output on a
# model this small; at this scale the network is chaotic enough that greedy text varies with the prompt.
_INIT_STD = 0.5


def _random_weights(config, arch: str, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; norm weights near 1 (not exactly, so a missing norm weight would show)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    std = config.initializer_range

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm_weight(n: int) -> torch.Tensor:  # near 1 as the norm applies it (Gemma stores w of 1 + w)
        return (0.0 if arch in _GEMMA else 1.0) + normal(n, scale=0.1)

    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    qwen2 = arch in ("qwen2", "qwen2_moe")
    qkv_bias = qwen2 or bool(getattr(config, "attention_bias", False))
    o_bias = not qwen2 and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    w = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, scale=1.0)}
    qk_widths = {"head": (head_dim, head_dim), "projection": (heads * head_dim, kv_heads * head_dim)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in _LAYER_NORMS.get(arch, ("input_layernorm", "post_attention_layernorm")):
            w[p + name + ".weight"] = norm_weight(hidden)
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, hidden)
            if qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = normal(hidden)
        if arch in _QK_NORM:
            q_width, k_width = qk_widths[_QK_NORM[arch]]
            w[p + "self_attn.q_norm.weight"] = norm_weight(q_width)
            w[p + "self_attn.k_norm.weight"] = norm_weight(k_width)
        if _sparse(config, arch, i):
            w.update(_moe_weights(config, arch, p, normal))
            continue
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        if mlp_bias:
            for name, rows in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
                w[p + f"mlp.{name}.bias"] = normal(rows)
    w["model.norm.weight"] = norm_weight(hidden)
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = normal(config.vocab_size, hidden)
    if arch == "phi3":
        _fuse(w, config.num_hidden_layers)
    return {k: v.contiguous() for k, v in w.items()}


def _fuse(w: dict, layers: int) -> None:
    """Phi-3's checkpoint layout: q/k/v rows in one qkv_proj, gate/up rows in one gate_up_proj."""
    import torch

    for i in range(layers):
        for module, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            p = f"model.layers.{i}."
            w[f"{p}{module}.weight"] = torch.cat([w.pop(f"{p}{part}.weight") for part in parts])


def _sparse(config, arch: str, layer: int) -> bool:
    """Whether a layer of the tiny model is a mixture of experts (transformers' rule for the Qwen MoEs)."""
    if arch == "mixtral":
        return True
    if arch not in MOE_ARCHS:
        return False
    return layer not in (config.mlp_only_layers or []) and (layer + 1) % config.decoder_sparse_step == 0


def _moe_weights(config, arch: str, p: str, normal) -> dict[str, torch.Tensor]:
    """One sparse layer's router and per-expert weights, named as the published checkpoints name them."""
    hidden = config.hidden_size
    if arch == "mixtral":
        block, inter, names = p + "block_sparse_moe.", config.intermediate_size, ("w1", "w3", "w2")
        experts = config.num_local_experts
    else:
        block, inter, names = p + "mlp.", config.moe_intermediate_size, ("gate_proj", "up_proj", "down_proj")
        experts = config.num_experts
    w = {block + "gate.weight": normal(experts, hidden)}
    for e in range(experts):
        w[f"{block}experts.{e}.{names[0]}.weight"] = normal(inter, hidden)
        w[f"{block}experts.{e}.{names[1]}.weight"] = normal(inter, hidden)
        w[f"{block}experts.{e}.{names[2]}.weight"] = normal(hidden, inter)
    shared = getattr(config, "shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
    if shared:
        w[block + "shared_expert.gate_proj.weight"] = normal(shared, hidden)
        w[block + "shared_expert.up_proj.weight"] = normal(shared, hidden)
        w[block + "shared_expert.down_proj.weight"] = normal(hidden, shared)
        w[block + "shared_expert_gate.weight"] = normal(1, hidden)
    return w


__all__ = ["ALL_ARCHS", "ARCHS", "FAMILY_ARCHS", "MOE_ARCHS", "TINY_WINDOW", "make_tiny_model"]
