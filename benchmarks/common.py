"""Shared pieces of the GPU experiments here and run.py: real model shapes, byte counting, bandwidth.

The shapes are the published hyperparameters of real checkpoints as config.json folders (benchmarks/shapes/NAME),
so the engine builds the exact shapes with random weights (load_format="dummy", skip_tokenizer_init): no download,
the same kernels, the same bytes moved. `nanoserve bench ... --model benchmarks/shapes/qwen3-0.6b --load-format
dummy --skip-tokenizer-init` runs any user-facing benchmark on one. The environment record and JSON writing
come from the package (nanoserve.bench).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from nanoserve.bench.common import environment as env_info  # noqa: F401 (the scripts' names for them)
from nanoserve.bench.common import release_memory as release_cuda_memory, write_json  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SHAPES_DIR = REPO_ROOT / "benchmarks" / "shapes"
MODEL_CONFIGS = {p.parent.name: json.loads(p.read_text()) for p in sorted(SHAPES_DIR.glob("*/config.json"))}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_config(name: str) -> dict:
    """A fresh copy of a named real-shape config (KeyError lists the known names)."""
    if name.lower() not in MODEL_CONFIGS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODEL_CONFIGS)}")
    return copy.deepcopy(MODEL_CONFIGS[name.lower()])


def write_model_dir(config: dict | str, directory: str | Path) -> Path:
    """config.json (a named shape or a dict) in directory, for load_format="dummy"."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model_config(config) if isinstance(config, str) else config
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Llama/Qwen-family decoder (and its mixtures of experts) by role."""

    per_layer: int  # a dense layer's (an MoE model's layers are counted in `layers`)
    layers: int  # all decoder layers
    final_norm: int
    embedding: int  # vocab × hidden
    lm_head: int  # vocab × hidden, 0 when tied to the embedding
    expert: int = 0  # one expert's gate/up/down
    num_experts: int = 0
    top_k: int = 0
    sparse_layers: int = 0

    @property
    def total(self) -> int:
        return self.layers + self.final_norm + self.embedding + self.lm_head

    @property
    def active(self) -> int:
        """What one token multiplies by: every weight but the unselected experts (and the embedding, a lookup)."""
        return self.total - self.embedding - self.sparse_layers * (self.num_experts - self.top_k) * self.expert

    def decode_read(self, rows: int) -> int:
        """Parameters a decode step of `rows` rows reads: all but the embedding (rows of it only), and of each MoE
        layer's experts the expected number that `rows` tokens select, uniform routing: E · (1 − (1 − k/E)^rows)."""
        if not self.num_experts:
            return self.total - self.embedding
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** rows)
        return round(self.total - self.embedding - self.sparse_layers * (self.num_experts - touched) * self.expert)


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def param_counts(cfg: dict) -> ParamCounts:
    """Weights from a HF config: q/k/v/o (+ q/k/v bias for Qwen2, all four with attention_bias, + q/k RMSNorm for
    Qwen3), gate/up/down, two RMSNorms per layer, final norm, embedding, untied lm_head."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim(cfg)
    model_type = cfg.get("model_type", "llama")
    q, kv = nh * d, nkv * d
    attn = h * q + 2 * h * kv + q * h
    if model_type in ("qwen2", "qwen2_moe"):  # Qwen2: q/k/v bias, no o_proj bias
        attn += q + 2 * kv
    elif cfg.get("attention_bias", False):  # Llama-style attention_bias: all four projections
        attn += q + 2 * kv + h
    if model_type in ("qwen3", "qwen3_moe"):
        attn += 2 * d  # q_norm, k_norm over head_dim
    mlp = 3 * h * inter + (2 * inter + h if cfg.get("mlp_bias", False) else 0)
    per_layer = attn + mlp + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    layers = cfg["num_hidden_layers"]
    moe = _moe_counts(cfg, h, layers)
    if moe is None:
        return ParamCounts(per_layer=per_layer, layers=per_layer * layers, final_norm=h,
                           embedding=vocab * h, lm_head=0 if tied else vocab * h)
    expert, experts, top_k, sparse, shared = moe
    sparse_layer = attn + 2 * h + experts * (expert + h) + (3 * h * shared + h if shared else 0)  # + the router
    return ParamCounts(per_layer=per_layer, layers=per_layer * (layers - sparse) + sparse_layer * sparse, final_norm=h,
                       embedding=vocab * h, lm_head=0 if tied else vocab * h, expert=expert, num_experts=experts,
                       top_k=top_k, sparse_layers=sparse)


def _moe_counts(cfg: dict, h: int, layers: int) -> tuple[int, int, int, int, int] | None:
    """(one expert's parameters, experts, top-k, sparse layers, shared expert's intermediate) of an MoE config."""
    model_type = cfg.get("model_type")
    if model_type == "mixtral":
        return 3 * h * cfg["intermediate_size"], cfg["num_local_experts"], cfg["num_experts_per_tok"], layers, 0
    if model_type not in ("qwen3_moe", "qwen2_moe"):
        return None
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
    sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return 3 * h * cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_experts_per_tok"], sparse, shared


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token across all layers (the engine's KVCacheSpec, for a config not yet loaded)."""
    import torch

    from nanoserve.runner.kv_cache import KVCacheSpec

    nkv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    return KVCacheSpec(cfg["num_hidden_layers"], nkv, head_dim(cfg), 1, dtype).bytes_per_token


def kv_blocks_needed(num_seqs: int, tokens_per_seq: int, block_size: int, spare: int = 1) -> int:
    """KV blocks for num_seqs disjoint sequences of tokens_per_seq tokens, plus `spare` (the padded rows' block)."""
    if num_seqs <= 0 or tokens_per_seq <= 0 or block_size <= 0:
        raise ValueError(f"need positive sizes, got {num_seqs=}, {tokens_per_seq=}, {block_size=}")
    from nanoserve.kernels.paging import blocks_for

    return num_seqs * blocks_for(tokens_per_seq, block_size) + spare


def padding_rows(batch_size: int, capture_sizes: list[int]) -> int:
    """Rows a graph computes for nothing (0 when the batch runs eagerly): the engine's bucket rule."""
    from nanoserve.runner.dispatch import bucket_for

    bucket = bucket_for(sorted(capture_sizes), batch_size)
    return 0 if bucket is None else bucket - batch_size


def back_to_back_seconds(fn, iters: int, warmup: int = 3) -> float:
    """Seconds of iters calls queued back to back between two CUDA events, after warmup calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (2 × nbytes per copy)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes * iters / back_to_back_seconds(lambda: dst.copy_(src), iters)
