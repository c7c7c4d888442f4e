"""What a model's files say, read without building the model: HF config, its shape (ModelSpec), max length,
tokenizer, EOS ids, and a GGUF file's metadata.

The ground floor of the package (it imports only other ground modules: errors, checkpoint_formats): the server, the engine and the
loader read a model folder or a .gguf file through here, and every refusal is one ModelLoadError line
naming the file at fault, raised before any weight is read. No torch: the API process and the CLI read
configs and tokenizers without it. Weights are model/loader.py's (safetensors) and model/gguf.py's.

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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Phi3ForCausalLM",
                           "Olmo2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "gemma3": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
# Multimodal checkpoints whose text model we run: its config is the config's text_config.
_TEXT_PARTS = ("Gemma3ForConditionalGeneration",)
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


@dataclass(frozen=True)
class Family:
    """How an architecture's decoder layer differs from Llama's: data the one model definition (model/llama.py) reads.

    norms: which RMSNorms a layer has around attention and the MLP: "pre" (Llama: input_layernorm before attention,
    post_attention_layernorm before the MLP), "sandwich" (Gemma: also a norm on each sub-layer's output) or "post"
    (OLMo-2: only on the outputs). norm_offset 1: the checkpoint stores w of a (1 + w) norm (Gemma). qk_norm: "head"
    (RMSNorm per head, Qwen3 / Gemma 3), "projection" (over all heads at once, OLMo-2) or None."""

    norms: str = "pre"
    norm_offset: float = 0.0
    qk_norm: str | None = None
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    window_everywhere: bool = False  # without layer_types, config.sliding_window applies to every layer


_FAMILIES = {"Qwen3ForCausalLM": Family(qk_norm="head"), "Qwen3MoeForCausalLM": Family(qk_norm="head"),
             "MistralForCausalLM": Family(window_everywhere=True), "MixtralForCausalLM": Family(window_everywhere=True),
             "Phi3ForCausalLM": Family(window_everywhere=True),
             "Gemma2ForCausalLM": Family("sandwich", 1.0, embed_scale=True),
             "Gemma3ForCausalLM": Family("sandwich", 1.0, "head", embed_scale=True),
             "Gemma3ForConditionalGeneration": Family("sandwich", 1.0, "head", embed_scale=True),
             "Olmo2ForCausalLM": Family("post", qk_norm="projection")}
# The MLP activations we run (HF's hidden_act / hidden_activation name → model/layers.py MLP's).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# Architectures users bring that look close to ours but need what nanoserve does not have: named in the refusal.
REFUSED_ARCHITECTURES = {"DeepseekV2ForCausalLM": "multi-head latent attention (MLA)",
                        "DeepseekV3ForCausalLM": "multi-head latent attention (MLA)",
                        "GptOssForCausalLM": "attention sinks and MXFP4 experts",
                        "Qwen3NextForCausalLM": "linear-attention (gated DeltaNet) layers",
                        "Llama4ForConditionalGeneration": "chunked attention and interleaved MoE layers",
                        "DbrxForCausalLM": "DBRX's fused expert layout and clipped qkv",
                        "OlmoeForCausalLM": "OLMoE's experts with q/k norm over the whole projection",
                        "GraniteMoeForCausalLM": "Granite's scaled residuals and logits"}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
# RoPE variants that are a fixed function of the position (their cos/sin is cached once and keys stored in the
# paged cache stay valid), with the settings each needs; "dynamic" and "longrope" rescale with the sequence length.
_ROPE_SETTINGS = {"default": (), "linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "yarn": ("original_max_position_embeddings",),
                  # one factor set fixed for the engine by its max length: model/layers.py's _longrope_inv_freq
                  "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor")}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_SETTINGS)
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
    """The shape of a model, read and validated from its HF config (a multimodal checkpoint's text_config)."""

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
    tie_word_embeddings: bool
    rope: dict  # full-attention layers' (every layer's unless local_rope)
    moe: MoeSpec | None = None
    family: Family = Family()
    activation: str = "silu"
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2's attention-logit soft-cap
    final_softcap: float | None = None  # Gemma's final-logit soft-cap
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES (empty: all full attention)
    sliding_window: int | None = None  # of the sliding_attention layers; None where it spans the whole context
    local_rope: dict | None = None  # sliding_attention layers' RoPE where it differs from rope (Gemma 3's local base)

    @property
    def qk_norm(self) -> str | None:
        return self.family.qk_norm

    def _sliding(self, index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[index] == "sliding_attention"

    def window(self, index: int) -> int | None:
        """Layer `index`'s sliding window; None for full attention."""
        return self.sliding_window if self._sliding(index) else None

    def layer_rope(self, index: int) -> dict:
        """Layer `index`'s RoPE settings."""
        return self.local_rope if self._sliding(index) and self.local_rope is not None else self.rope

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelSpec":
        """Raises ValueError naming the first unsupported feature."""
        arch = architecture_of(hf_config)
        cfg = text_config(hf_config, arch)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported (only {', '.join(map(repr, _ACTIVATIONS))})")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported (only causal attention)")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        family = _FAMILIES.get(arch, Family())
        ropes, types = layer_rope_parameters(cfg), layer_types(cfg, family)
        scalar = getattr(cfg, "query_pre_attn_scalar", None) if arch in _GEMMA else None
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            qkv_bias=bool(getattr(cfg, "qkv_bias", True)) if qwen2 else attention_bias,
            o_bias=False if qwen2 else attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope=ropes["full_attention"],
            moe=MoeSpec.from_hf_config(cfg, arch),
            family=family,
            activation=_ACTIVATIONS[act],
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if arch in _GEMMA else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if arch in _GEMMA else None,
            layer_types=types,
            sliding_window=sliding_window(cfg) if "sliding_attention" in types else None,
            local_rope=ropes["sliding_attention"] if ropes["sliding_attention"] != ropes["full_attention"] else None,
        )


def text_config(hf_config, arch: str | None = None):
    """The config of the text model: a multimodal checkpoint's text_config, else the config itself."""
    if (arch or architecture_of(hf_config)) in _TEXT_PARTS:
        return hf_config.text_config
    return hf_config


def layer_types(cfg, family: Family = Family()) -> tuple[str, ...]:
    """Each layer's attention type as transformers applies it: the config's `layer_types`, else sliding_attention on
    every layer for the families that window them all (Mistral, Mixtral, Phi-3; no window set: full after all)."""
    layers = cfg.num_hidden_layers
    types = tuple(getattr(cfg, "layer_types", None) or ())
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (only {', '.join(LAYER_TYPES)})")
    if not types:
        return ("sliding_attention" if family.window_everywhere else "full_attention",) * layers
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={layers}")
    return types


def sliding_window(cfg) -> int | None:
    """The sliding_attention layers' window; None where it spans the whole context (then it changes nothing)."""
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < 1:
        raise ValueError(f"sliding_window={window} must be positive")
    return None if window is None or window >= cfg.max_position_embeddings else int(window)


def layer_rope_parameters(cfg) -> dict[str, dict]:
    """rope_parameters for each of LAYER_TYPES: transformers 5 stores them per layer type where they differ (Gemma 3:
    {"full_attention": {...}, "sliding_attention": {...}}); otherwise both are the config's one set."""
    params = getattr(cfg, "rope_parameters", None)
    if not (isinstance(params, dict) and set(params) & set(LAYER_TYPES)):
        one = rope_parameters(cfg)
        return {t: one for t in LAYER_TYPES}
    out = {}
    for layer_type in LAYER_TYPES:
        if not params.get(layer_type):
            raise ValueError(f"rope_parameters has no settings for {layer_type!r} layers")
        out[layer_type] = rope_parameters(_WithRope(cfg, params[layer_type]))
    return out


class _WithRope:
    """A config seen with one layer type's rope_parameters (what rope_parameters reads), all else the config's."""

    def __init__(self, cfg, params: dict) -> None:
        self._cfg, self.rope_parameters = cfg, params

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)


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


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings as one flat dict with rope_type, rope_theta and partial_rotary_factor (1.0 unless
    the config rotates only part of each head) (transformers 4.x or 5.x layout), checked: a supported rope_type with
    every setting it needs (model/layers.py's rope_inv_freq reads them)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_type" not in params and "rope_theta" not in params:
        raise ValueError(f"per-layer RoPE parameters {sorted(params)} are not supported")
    rope_type = params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type not in _ROPE_SETTINGS:
        why = " (it rescales with the sequence length, so cached keys would go stale)" if rope_type == "dynamic" else ""
        raise ValueError(f"unsupported rope_type {rope_type!r}{why}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    params["partial_rotary_factor"] = 1.0 if factor is None else float(factor)  # rotary_dim = int(head_dim · this)
    if not 0.0 < params["partial_rotary_factor"] <= 1.0:
        raise ValueError(f"partial_rotary_factor={factor} must be in (0, 1]")
    if getattr(hf_config, "original_max_position_embeddings", None) is not None:  # transformers 4.x: Phi-3 keeps it here
        params.setdefault("original_max_position_embeddings", hf_config.original_max_position_embeddings)
    if rope_type == "longrope" and params.get("factor") is None and "original_max_position_embeddings" in params:
        # HF's default, from the config rather than the engine's max length (which picks the factor set)
        params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    for name in _ROPE_SETTINGS[rope_type]:
        if name not in params:
            raise ValueError(f"rope_type {rope_type!r} needs the setting {name!r}")
    return params


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


__all__ = ["Family", "Fp8Checkpoint", "LAYER_TYPES", "ModelLoadError", "ModelSpec", "MoeSpec", "REFUSED_ARCHITECTURES",
           "unsupported_architecture", "checkpoint_quantization", "SUPPORTED_ARCHITECTURES",
           "SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "architecture_of", "as_id_list", "eos_token_ids",
           "first_line", "is_gguf", "load_hf_config", "load_tokenizer", "model_max_len", "layer_rope_parameters",
           "layer_types", "read_gguf_metadata", "rope_parameters", "sliding_window", "text_config"]
