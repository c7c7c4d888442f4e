"""What a model's files say, read without building the model: HF config, its shape (ModelSpec), max length,
tokenizer, EOS ids, and a GGUF file's metadata.

The ground floor of the package (it imports only other ground modules: errors, checkpoint_formats, rope_config,
model_spec; ModelSpec and the architecture tables are model_spec's, re-exported here):
the server, the engine and the loader read a model folder or a .gguf file through here, and every refusal is one
ModelLoadError line naming the file at fault, raised before any weight is read. No torch: the API process and the
CLI read configs and tokenizers without it. Weights are model/loader.py's (safetensors) and model/gguf.py's.

A GGUF file is read by transformers (config and tokenizer from the metadata, the code behind
`from_pretrained(..., gguf_file=...)`); nothing here parses the format by hand beyond its magic bytes.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from nanoserve.checkpoint_formats import Fp8Checkpoint, checkpoint_quantization  # noqa: F401 (re-exported)
from nanoserve.errors import ModelLoadError
from nanoserve.model_spec import (LAYER_TYPES, REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES,  # noqa: F401
                                  Family, ModelSpec, MoeSpec, architecture_of, layer_rope_parameters, layer_types,
                                  sliding_window, text_config, unsupported_architecture)
from nanoserve.rope_config import SUPPORTED_ROPE_TYPES, rope_parameters  # noqa: F401 (re-exported)

# GGUF architectures transformers reads a config from (its GGUF_CONFIG_MAPPING) that we run; Mistral files are
# "llama". OLMo-2 ("olmo2") has no transformers mapping, so it is refused with the rest.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3")
# llama.cpp picks Gemma's attention scale by model size (the file does not state it): 1/sqrt(hidden / heads) for
# the 27B models, known by their layer count, else 1/sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Where the config's window is the file's, not transformers' class default: Phi-3 (its mapping skips the key) and
# llama (a file named "mistral" gets MistralConfig's 4096; llama.cpp's Mistral files state none and run unwindowed).
_GGUF_WINDOW_ARCHS = ("llama", "phi3")
_GGUF_MAGIC = b"GGUF"
# Metadata keys of the tokens that end a generation besides EOS (end of turn, end of message).
_GGUF_EXTRA_STOP_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_GGUF_SPECIAL_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                            "unk_token": "tokenizer.ggml.unknown_token_id",
                            "pad_token": "tokenizer.ggml.padding_token_id"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# -- config and max length ---------------------------------------------------------------------------------
def load_hf_config(model_dir: str | Path):
    """The folder's config.json (or a GGUF file's metadata) as a transformers PretrainedConfig, validated for this
    engine: a supported architecture and features (ModelSpec), weights stored unquantized."""
    if is_gguf(model_dir):
        return _load_gguf_config(Path(model_dir))
    from transformers import AutoConfig

    path = Path(model_dir)
    check_model_exists(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in model folder {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(f"{config_file}: {unsupported_architecture(archs)}")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError/TypeError for bad configs
        raise ModelLoadError(f"cannot parse {config_file}: {first_line(e)}") from None
    _check_spec(config, config_file)
    checkpoint_quantization(raw.get("quantization_config"), config_file)
    return config


def check_model_exists(path: str | Path) -> None:
    """A missing model path, refused in one line: asked first (hub.resolve_config), before the CLI imports torch and
    transformers (seconds)."""
    if not Path(path).exists():
        raise ModelLoadError(f"model {'file' if is_gguf(path) else 'folder'} {str(path)!r} does not exist")


def _check_spec(config, source: Path) -> None:
    try:
        ModelSpec.from_hf_config(config)
    except (ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{source}: {first_line(e)}") from None


def load_draft_hf_config(path: str):
    """A draft model's config (speculative_config "draft_model"), checked like the model's; its errors say whose."""
    try:
        return load_hf_config(path)
    except (ModelLoadError, ValueError, OSError) as e:
        raise ValueError(f"speculative_config: the draft model {path!r}: {e}") from None


def model_max_len(hf_config) -> int:
    return int(text_config(hf_config).max_position_embeddings)


# -- tokenizer and EOS -------------------------------------------------------------------------------------
def load_tokenizer(model_dir: str | Path):
    """The folder's tokenizer (AutoTokenizer, local files only), or the one a GGUF file stores."""
    if is_gguf(model_dir):
        return _load_gguf_tokenizer(Path(model_dir))
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer folder {str(path)!r} does not exist")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer in {str(path)!r} (expected one of {', '.join(_TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ModelLoadError(f"cannot load the tokenizer in {str(path)!r}: {first_line(e)}") from None


def eos_token_ids(model_dir: str | Path, hf_config, tokenizer=None) -> list[int]:
    """Token ids that end a generation: generation_config.json, else config.json, else the tokenizer's EOS; for a
    GGUF file, EOS then the end-of-turn / end-of-message ids it names (llama.cpp stops on all of them)."""
    if is_gguf(model_dir):
        return _gguf_eos_token_ids(Path(model_dir), hf_config, tokenizer)
    gen_file = Path(model_dir) / "generation_config.json"
    if gen_file.is_file():
        try:
            ids = as_id_list(json.loads(gen_file.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"{gen_file} is not valid JSON: {e}") from None
        if ids:
            return ids
    ids = as_id_list(getattr(hf_config, "eos_token_id", None))
    if ids:
        return ids
    if tokenizer is not None:
        return as_id_list(getattr(tokenizer, "eos_token_id", None))
    return []


def as_id_list(value) -> list[int]:
    """A config's token id or ids as a list of distinct ints (None, bools and other types dropped)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return list(dict.fromkeys(v for v in values if isinstance(v, int) and not isinstance(v, bool)))  # in order


# -- GGUF metadata -----------------------------------------------------------------------------------------
def is_gguf(path: str | Path) -> bool:
    """Whether a model path names a GGUF file (by its suffix, so a bad file still gets GGUF's errors)."""
    return str(path).lower().endswith(".gguf")


def read_gguf_metadata(path: str | Path) -> dict:
    """The file's metadata keys (string arrays such as the vocabulary come back as their lengths)."""
    path = Path(path)
    check_model_exists(path)
    if not path.is_file():
        raise ModelLoadError(f"model path {str(path)!r} ends in .gguf but is not a file")
    with open(path, "rb") as f:
        if f.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from transformers.integrations.gguf import read_gguf_metadata as read
    except ImportError:
        import transformers
        raise ModelLoadError(f"loading GGUF files needs transformers >= 5.17 (found {transformers.__version__})") from None
    try:
        metadata, _ = read(str(path))
    except (ValueError, struct.error, UnicodeDecodeError, KeyError, IndexError, OverflowError) as e:
        raise ModelLoadError(f"{path} is truncated or corrupt: {first_line(e)}") from None
    return metadata


def _load_gguf_config(path: Path):
    from transformers import AutoConfig

    metadata = read_gguf_metadata(path)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    if arch == "llama" and metadata.get("llama.expert_count"):  # transformers reads a dense LlamaConfig from it
        raise ModelLoadError(f"{path}: Mixtral GGUF files (llama architecture with {metadata['llama.expert_count']} "
                             "experts) are not supported; load the Mixtral safetensors folder instead")
    if arch == "phi3" and metadata.get("phi3.rope.scaling.attn_factor") is not None:  # written with rope_factors_*
        raise ModelLoadError(f"{path}: phi3 GGUF files with LongRoPE factors (long-context Phi-3) are not "
                             "supported; load the safetensors folder instead")
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # gguf/numpy raise ValueError, struct.error, IndexError... for damaged files
        raise ModelLoadError(f"{path} is truncated or corrupt: {first_line(e)}") from None
    # Qwen3's head_dim is not hidden/heads; the file states it, but transformers' mapping reads it only for llama.
    key_length = metadata.get(f"{arch}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0:
        config.head_dim = key_length
    if arch in ("qwen2moe", "qwen3moe"):
        _set_gguf_expert_sizes(config, metadata, arch)
    if arch in _GEMMA_27B_LAYERS:
        _set_gguf_gemma(config, metadata, arch)
    _set_gguf_rope(config, metadata, arch)
    if arch in _GGUF_WINDOW_ARCHS and hasattr(config, "sliding_window"):
        window = metadata.get(f"{arch}.attention.sliding_window")  # absent or 0: none, as llama.cpp runs the file
        config.sliding_window = window if isinstance(window, int) and window > 0 else None
    _check_spec(config, path)
    return config


def _set_gguf_gemma(config, metadata: dict, arch: str) -> None:
    """The soft-caps the file states (transformers' mapping keeps the class defaults, Gemma 2's 50 and 30) and the
    attention scale llama.cpp derives (the file has no query_pre_attn_scalar)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            setattr(config, key, float(value))
    big = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim


def _set_gguf_rope(config, metadata: dict, arch: str) -> None:
    """RoPE settings the file states that transformers' mapping skips: the rotated share of each head
    (rope.dimension_count: Phi-3's partial rotary), linear scaling (on Gemma 3's global layers only, as llama.cpp
    applies it) and Phi-3's original context length."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    per_type = [params[t] for t in LAYER_TYPES if t in params] or [params]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dims = metadata.get(f"{arch}.rope.dimension_count")
    if isinstance(dims, int) and 0 < dims < head_dim:
        for layer_params in per_type:
            layer_params["partial_rotary_factor"] = dims / head_dim
    full = params.get("full_attention", params)
    if metadata.get(f"{arch}.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(metadata.get(f"{arch}.rope.scaling.factor", 1.0)))
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if isinstance(original, int) and hasattr(config, "original_max_position_embeddings"):
        config.original_max_position_embeddings = original


def _set_gguf_expert_sizes(config, metadata: dict, arch: str) -> None:
    """The expert sizes the file states but transformers' GGUF mapping skips (it would keep the config class's
    defaults, Qwen1.5-MoE's and Qwen3-30B-A3B's); a missing key falls back as llama.cpp's loader does."""
    ff = metadata.get(f"{arch}.feed_forward_length", 0)
    used = max(config.num_experts_per_tok, 1)  # a top-k of 0 is MoeSpec's to refuse, in one line
    config.moe_intermediate_size = metadata.get(f"{arch}.expert_feed_forward_length") or ff // used
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = metadata.get(f"{arch}.expert_shared_feed_forward_length") or ff


def _load_gguf_tokenizer(path: Path):
    """The tokenizer (vocabulary, merges, chat template) stored in the file.

    Special tokens are set from the file's token ids: transformers 5.17 names the wrong EOS token for
    some files (SmolLM2: <|im_start|>), which would leak into chat templates and skip_special_tokens.
    """
    from transformers import PreTrainedTokenizerFast

    metadata = read_gguf_metadata(path)
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            local_files_only=True)
    except Exception as e:  # transformers raises many types for tokenizers it cannot build
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {first_line(e)}") from None
    for attribute, key in _GGUF_SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def _gguf_eos_token_ids(path: Path, hf_config, tokenizer=None) -> list[int]:
    metadata = read_gguf_metadata(path)
    ids = as_id_list(getattr(hf_config, "eos_token_id", None))
    for key in _GGUF_EXTRA_STOP_KEYS:
        for token_id in as_id_list(metadata.get(key)):
            if token_id not in ids:
                ids.append(token_id)
    if not ids and tokenizer is not None:
        ids = as_id_list(getattr(tokenizer, "eos_token_id", None))
    return ids


def first_line(e: BaseException) -> str:
    """An exception's message on one line (its type when it has none): what a ModelLoadError quotes."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["Family", "Fp8Checkpoint", "LAYER_TYPES", "ModelLoadError", "ModelSpec", "MoeSpec", "REFUSED_ARCHITECTURES",
           "unsupported_architecture", "checkpoint_quantization", "SUPPORTED_ARCHITECTURES",
           "SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "architecture_of", "as_id_list", "eos_token_ids",
           "first_line", "is_gguf", "load_hf_config", "load_tokenizer", "model_max_len", "layer_rope_parameters",
           "layer_types", "read_gguf_metadata", "rope_parameters", "sliding_window", "text_config"]
