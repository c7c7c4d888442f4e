"""What a model's files say, read without building the model: HF config, its shape (ModelSpec), max length,
tokenizer, EOS ids, and a GGUF file's metadata.

The ground floor of the package (it imports only other ground modules: errors, checkpoint_formats, rope_config):
the server, the engine and the loader read a model folder or a .gguf file through here, and every refusal is one
ModelLoadError line naming the file at fault, raised before any weight is read. No torch: the API process and the
CLI read configs and tokenizers without it. Weights are model/loader.py's (safetensors) and model/gguf.py's.

A GGUF file is read by transformers (config and tokenizer from the metadata, the code behind
`from_pretrained(..., gguf_file=...)`); nothing here parses the format by hand beyond its magic bytes.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from nanoserve.checkpoint_formats import Fp8Checkpoint, checkpoint_quantization  # noqa: F401 (re-exported)
from nanoserve.errors import ModelLoadError
from nanoserve.rope_config import SUPPORTED_ROPE_TYPES, rope_parameters  # noqa: F401 (re-exported)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
# Architectures users bring that look close to ours but need what nanoserve does not have: named in the refusal.
REFUSED_ARCHITECTURES = {"DeepseekV2ForCausalLM": "multi-head latent attention (MLA)",
                        "DeepseekV3ForCausalLM": "multi-head latent attention (MLA)",
                        "GptOssForCausalLM": "attention sinks and MXFP4 experts",
                        "Qwen3NextForCausalLM": "linear-attention (gated DeltaNet) layers",
                        "Llama4ForConditionalGeneration": "chunked attention and interleaved MoE layers",
                        "DbrxForCausalLM": "DBRX's fused expert layout and clipped qkv",
                        "OlmoeForCausalLM": "OLMoE's q/k norm over the whole projection",
                        "GraniteMoeForCausalLM": "Granite's scaled residuals and logits"}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
_GGUF_MAGIC = b"GGUF"
# Metadata keys of the tokens that end a generation besides EOS (end of turn, end of message).
_GGUF_EXTRA_STOP_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_GGUF_SPECIAL_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                            "unk_token": "tokenizer.ggml.unknown_token_id",
                            "pad_token": "tokenizer.ggml.padding_token_id"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts part of a model: which layers route each token to top_k of num_experts SwiGLU experts."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k softmax weights divided by their sum (Mixtral always; Qwen's norm_topk_prob)
    shared_intermediate_size: int  # Qwen2-MoE's gated shared expert; 0 for none
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of intermediate_size

    @classmethod
    def from_hf_config(cls, hf_config, arch: str) -> "MoeSpec | None":
        layers = hf_config.num_hidden_layers
        if arch == "MixtralForCausalLM":
            return cls._checked(hf_config.num_local_experts, hf_config.num_experts_per_tok,
                                hf_config.intermediate_size, True, 0, (True,) * layers)
        if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return None
        experts, step = hf_config.num_experts, getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        return cls._checked(experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                            bool(getattr(hf_config, "norm_topk_prob", False)), int(shared or 0), sparse)

    @classmethod
    def _checked(cls, experts: int, top_k: int, inter: int, renormalize: bool, shared: int,
                 sparse: tuple[bool, ...]) -> "MoeSpec":
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})")
        return cls(experts, top_k, inter, renormalize, shared, sparse)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model, read and validated from its HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope: dict
    moe: MoeSpec | None = None

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelSpec":
        """Raises ValueError naming the first unsupported feature."""
        arch = architecture_of(hf_config)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        _check_no_sliding_window(hf_config, arch)
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            qkv_bias=bool(getattr(hf_config, "qkv_bias", True)) if qwen2 else attention_bias,
            o_bias=False if qwen2 else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rope=rope_parameters(hf_config),
            moe=MoeSpec.from_hf_config(hf_config, arch),
        )


def architecture_of(hf_config) -> str:
    """The supported architecture name of a config, or ValueError naming the supported ones."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[hf_config.model_type]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(unsupported_architecture(names or [getattr(hf_config, "model_type", None)]))


def unsupported_architecture(names: list) -> str:
    """The refusal of a config's architectures: what is missing for one we know of, and what we run."""
    why = next((f" ({REFUSED_ARCHITECTURES[n]} is not implemented)" for n in names if n in REFUSED_ARCHITECTURES), "")
    return f"unsupported architecture {names}{why}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _check_no_sliding_window(hf_config, arch: str) -> None:
    """Sliding-window attention is not implemented; refuse configs where it would change the result."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types {sorted(set(layer_types))}: only full attention is supported (no sliding window)")
    window = getattr(hf_config, "sliding_window", None)
    if window is None or window >= hf_config.max_position_embeddings:
        return
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") or getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"sliding_window={window} is not supported (only full attention)")


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


def model_max_len(hf_config) -> int:
    return int(hf_config.max_position_embeddings)


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
    _check_spec(config, path)
    return config


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


__all__ = ["Fp8Checkpoint", "ModelLoadError", "ModelSpec", "MoeSpec", "REFUSED_ARCHITECTURES",
           "unsupported_architecture", "checkpoint_quantization", "SUPPORTED_ARCHITECTURES",
           "SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "architecture_of", "as_id_list", "eos_token_ids",
           "first_line", "is_gguf", "load_hf_config", "load_tokenizer", "model_max_len", "read_gguf_metadata",
           "rope_parameters"]
