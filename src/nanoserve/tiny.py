"""Tiny random Llama / Qwen2 / Qwen3 checkpoints in Hugging Face format, built offline in well under a second.

Tests and demos need a real model folder (config.json, model.safetensors, a working tokenizer with a chat
template, generation_config.json) without downloading anything. The weights are random but large enough
that greedy decoding wanders instead of repeating one token, so engine-vs-transformers comparisons mean something.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = ("llama", "qwen2", "qwen3")

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
    """Write a tiny random model of `arch` ("llama", "qwen2", "qwen3") to out_dir and return the folder.

    llama: Llama 3.1-style rope_scaling ("llama3"), untied lm_head. qwen2: qkv bias, tied embeddings.
    qwen3: per-head q/k RMSNorm, head_dim != hidden_size / num_heads. config_overrides replace config fields.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    written = [Path(p) for p in tokenizer.save_pretrained(str(out))]
    config = _build_config(arch, len(tokenizer), tokenizer, config_overrides)
    config.save_pretrained(str(out))
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
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

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
    g = torch.Generator().manual_seed(seed)
    std = config.initializer_range

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, scale=0.1)

    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    qkv_bias = arch == "qwen2" or bool(getattr(config, "attention_bias", False))
    o_bias = arch != "qwen2" and bool(getattr(config, "attention_bias", False))
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
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm_weight(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm_weight(head_dim)
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


__all__ = ["ARCHS", "make_tiny_model"]
