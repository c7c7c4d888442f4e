"""A model's shape and family read from its Hugging Face config (ModelSpec), and the architectures we run.

A ground module (it imports only rope_config): model_files re-exports all of it, model/llama.py builds the one model
definition from a ModelSpec, preflight checks tensor-parallel sizes against it. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.rope_config import rope_parameters

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

    @property
    def uniform_window(self) -> int | None:
        """The sliding window when every layer has one (Mistral-v0.1, Phi-3-mini): blocks before it are never read.
        None when any layer attends to the whole context (Gemma 2/3's global layers read every block)."""
        if self.layer_types and all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window
        return None

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


__all__ = ["Family", "LAYER_TYPES", "ModelSpec", "MoeSpec", "REFUSED_ARCHITECTURES", "SUPPORTED_ARCHITECTURES",
           "architecture_of", "layer_rope_parameters", "layer_types", "sliding_window", "text_config",
           "unsupported_architecture"]
