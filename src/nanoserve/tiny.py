"""Tiny random Llama / Qwen2 / Qwen3 checkpoints and their mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE) in
Hugging Face format, built offline in well under a second.

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
    """Write a tiny random model of `arch` (ARCHS or MOE_ARCHS) to out_dir and return the folder.

    llama: Llama 3.1-style rope_scaling ("llama3"), untied lm_head. qwen2: qkv bias, tied embeddings.
    qwen3: per-head q/k RMSNorm, head_dim != hidden_size / num_heads. The MoE archs store their experts per expert,
    as published (Mixtral under block_sparse_moe with w1/w3/w2). config_overrides replace config fields.
    """
    if arch not in ARCHS + MOE_ARCHS:
        raise ValueError(f"arch must be one of {ARCHS + MOE_ARCHS}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    written = [Path(p) for p in tokenizer.save_pretrained(str(out))]
    config = _build_config(arch, len(tokenizer), tokenizer, config_overrides)
    config.save_pretrained(str(out))
    from safetensors.torch import save_file

    save_file(_random_weights(config, arch, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)]
    generation_config = {"bos_token_id": config.bos_token_id, "eos_token_id": eos_ids, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    written += [out / "config.json", out / "model.safetensors", out / "generation_config.json"]
    _make_readable(out, written)
    return out


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
    from transformers import (LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

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

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, scale=0.1)

    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    qwen2 = arch in ("qwen2", "qwen2_moe")
    qkv_bias = qwen2 or bool(getattr(config, "attention_bias", False))
    o_bias = not qwen2 and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    w = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, scale=1.0)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(hidden)
        w[p + "post_attention_layernorm.weight"] = norm_weight(hidden)
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, hidden)
            if qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = normal(hidden)
        if arch in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm_weight(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm_weight(head_dim)
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
    return {k: v.contiguous() for k, v in w.items()}


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


__all__ = ["ARCHS", "MOE_ARCHS", "make_tiny_model"]
