"""Shared pieces for the benchmarks and run.py: real model shapes, byte counting, timing, reports.

The model configs are the published hyperparameters of real checkpoints, written as a
config.json so the engine can build the exact shapes with random weights
(load_format="dummy") — no download, same kernels, same bytes moved.
"""
from __future__ import annotations

import copy
import datetime as _dt
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

QWEN3_0_6B: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "torch_dtype": "bfloat16",
}

LLAMA_3_1_8B: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

# The shape of SmolLM2-135M(-Instruct): a tiny model whose step is all launch overhead (floor ~0.06 ms).
SMOLLM2_135M: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.041666666666666664,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

MODEL_CONFIGS: dict[str, dict] = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.1-8b": LLAMA_3_1_8B,
                                  "smollm2-135m": SMOLLM2_135M}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_config(name: str) -> dict:
    """A fresh copy of a named real-shape config (KeyError lists the known names)."""
    key = name.lower()
    if key not in MODEL_CONFIGS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODEL_CONFIGS)}")
    return copy.deepcopy(MODEL_CONFIGS[key])


def write_model_dir(config: dict | str, directory: str | Path) -> Path:
    """Write config.json (a named config or a dict) into directory; the engine then builds the
    model with load_format="dummy" (random weights), skip_tokenizer_init=True."""
    cfg = model_config(config) if isinstance(config, str) else config
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Byte counting (pure; unit-tested against hand-computed numbers)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Llama/Qwen-family decoder by role."""

    per_layer: int
    layers: int  # per_layer × num_hidden_layers
    final_norm: int
    embedding: int  # vocab × hidden
    lm_head: int  # vocab × hidden, 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.layers + self.final_norm + self.embedding + self.lm_head


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def param_counts(cfg: dict) -> ParamCounts:
    """Count weights from a HF config: q/k/v/o (+ q/k/v bias for Qwen2, all four biases with
    attention_bias, + q/k RMSNorm for Qwen3), gate/up/down, two RMSNorms per layer, final norm,
    embedding, untied lm_head."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim(cfg)
    model_type = cfg.get("model_type", "llama")
    q, kv = nh * d, nkv * d
    attn = h * q + 2 * h * kv + q * h
    if model_type == "qwen2":  # Qwen2: q/k/v bias, no o_proj bias
        attn += q + 2 * kv
    elif cfg.get("attention_bias", False):  # Llama-style attention_bias: all four projections
        attn += q + 2 * kv + h
    if model_type == "qwen3":
        attn += 2 * d  # q_norm, k_norm over head_dim
    mlp = 3 * h * inter
    if cfg.get("mlp_bias", False):
        mlp += 2 * inter + h
    per_layer = attn + mlp + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    return ParamCounts(
        per_layer=per_layer,
        layers=per_layer * cfg["num_hidden_layers"],
        final_norm=h,
        embedding=vocab * h,
        lm_head=0 if tied else vocab * h,
    )


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token across all layers (the engine's KVCacheSpec, for a config not yet loaded)."""
    from nanoserve.runner.kv_cache import KVCacheSpec

    nkv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    return KVCacheSpec(cfg["num_hidden_layers"], nkv, head_dim(cfg), 1, dtype).bytes_per_token


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step must read from HBM at minimum."""

    weights: int  # every weight once, the lm_head whole, the embedding only for the b looked-up rows
    kv: int  # K and V of b × context tokens
    batch_size: int
    context: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def linear_params_per_layer(cfg: dict) -> int:
    """Weights of one decoder layer's projections (q, k, v, o, gate, up, down), without biases."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * d, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * d
    return 2 * h * q + 2 * h * kv + 3 * h * inter


def decode_bytes(cfg: dict, batch_size: int, context: int, dtype_bytes: int = 2, linear_bytes: int | None = None,
                 lm_head_bytes: int | None = None) -> DecodeBytes:
    """Minimum HBM bytes of one decode step of batch_size rows, each attending to `context` tokens.

    The embedding gather reads only b rows, but the lm_head GEMM reads its whole matrix; for tied
    models that matrix IS the embedding, so it is counted once (the b gathered rows are part of it).
    linear_bytes / lm_head_bytes: bytes per weight of the decoder projections / the lm_head when they differ
    from dtype_bytes (fp8: 1; the per-channel scales are counted, 4 bytes a row).
    """
    p = param_counts(cfg)
    linears = linear_params_per_layer(cfg) * cfg["num_hidden_layers"]
    head = cfg["vocab_size"] * cfg["hidden_size"]
    weights = (p.layers - linears + p.final_norm) * dtype_bytes
    weights += linears * (linear_bytes or dtype_bytes) + head * (lm_head_bytes or dtype_bytes)
    if linear_bytes is not None and linear_bytes != dtype_bytes:  # one fp32 scale per output row
        h, d = cfg["hidden_size"], head_dim(cfg)
        rows = (cfg["num_attention_heads"] + 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"])) * d
        weights += 4 * (rows + h + 2 * cfg["intermediate_size"] + h) * cfg["num_hidden_layers"]
    if p.lm_head or lm_head_bytes not in (None, dtype_bytes):  # the embedding table is read for b rows only
        weights += batch_size * cfg["hidden_size"] * dtype_bytes
    return DecodeBytes(
        weights=weights,
        kv=batch_size * context * kv_bytes_per_token(cfg, dtype_bytes),
        batch_size=batch_size,
        context=context,
    )


def hbm_floor_ms(cfg: dict, batch_size: int, context: int, bandwidth_bytes_per_s: float, dtype_bytes: int = 2) -> float:
    """Lower bound on ms per decode step: minimum bytes ÷ the measured copy bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    return decode_bytes(cfg, batch_size, context, dtype_bytes).total / bandwidth_bytes_per_s * 1e3


def kv_blocks_needed(num_seqs: int, tokens_per_seq: int, block_size: int, spare: int = 1) -> int:
    """KV blocks for num_seqs disjoint sequences of tokens_per_seq tokens, plus `spare` blocks
    (the engine reserves one dummy block for padded graph rows)."""
    if num_seqs <= 0 or tokens_per_seq <= 0 or block_size <= 0:
        raise ValueError(f"need positive sizes, got {num_seqs=}, {tokens_per_seq=}, {block_size=}")
    from nanoserve.kernels.paging import blocks_for

    return num_seqs * blocks_for(tokens_per_seq, block_size) + spare


def fit_batch_sizes(cfg: dict, batch_sizes: list[int], tokens_per_seq: int, block_size: int,
                    free_bytes: int, dtype_bytes: int = 2, headroom: float = 0.8) -> tuple[list[int], int]:
    """Drop the largest batch sizes until weights + KV for the largest one fit in headroom × free memory.
    Returns (kept sizes, KV blocks to allocate); kept is empty when even b = 1 does not fit."""
    weights = param_counts(cfg).total * dtype_bytes
    sizes = sorted(batch_sizes)
    while sizes:
        blocks = kv_blocks_needed(sizes[-1], tokens_per_seq, block_size, spare=2)
        kv = blocks * block_size * kv_bytes_per_token(cfg, dtype_bytes)
        if weights + kv <= headroom * free_bytes:
            return sizes, blocks
        sizes.pop()
    return [], 0


def bucket_for(batch_size: int, capture_sizes: list[int]) -> int | None:
    """The graph a batch of batch_size rows replays (the engine's own rule)."""
    from nanoserve.runner.bucket_plan import bucket_for as engine_bucket_for

    return engine_bucket_for(sorted(capture_sizes), batch_size)


def padding_rows(batch_size: int, capture_sizes: list[int]) -> int:
    """Rows the graph computes for nothing (0 when the batch runs eagerly)."""
    bucket = bucket_for(batch_size, capture_sizes)
    return 0 if bucket is None else bucket - batch_size


def power_of_two_sizes(max_size: int) -> list[int]:
    """The engine's default buckets (powers of two, plus max_size)."""
    from nanoserve.config import default_capture_sizes

    return default_capture_sizes(max_size)


# ---------------------------------------------------------------------------------------------
# Timing and bandwidth (time_ms: the package's one timing loop, nanoserve/runner/timing.py)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device | str, warmup: int = 5, iters: int = 30) -> list[float]:
    """Per-call times in ms: the package's timing loop (CUDA events after a synchronize; perf_counter on CPU)."""
    from nanoserve.runner.timing import time_ms as package_time_ms

    return package_time_ms(fn, device, warmup, iters)


def summarize_ms(samples: list[float]) -> dict:
    if not samples:
        raise ValueError("no timing samples")
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "p90": ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))],
        "n": len(ordered),
    }


def measure_copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (2 × nbytes per copy)."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    return 2 * nbytes * iters / seconds


# ---------------------------------------------------------------------------------------------
# Environment and reports


def env_info() -> dict:
    """What a result must carry to be comparable later: versions, GPU, date, command line, commit."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    for module in ("triton", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # not installed, or broken install: record absence, not fail
            info[module] = None
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except Exception:
        info["git_commit"] = None
    return info


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_json(path: str | Path, data: dict) -> Path:
    """Write data as indented JSON (NaN/inf become null, unknown objects their str())."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(data), indent=2) + "\n")
    return path


def release_cuda_memory() -> None:
    """After `del engine`: collect cycles (graphs and pools die with their owners), then return
    cached blocks so the next model starts from an empty allocator."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Device scripts: stages under a time limit


def stage(name: str, cmd: list[str], timeout_s: int, log) -> dict:
    """Run one stage, its output appended to the log and echoed; the exit code and seconds come back."""
    print(f"\n##### {name}: {' '.join(cmd)} (limit {timeout_s} s)", flush=True)
    log.write(f"\n##### {name}: {' '.join(cmd)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        code = "timeout"
    log.write(out)
    log.flush()
    tail = out.strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"stage": name, "exit": code, "seconds": round(time.perf_counter() - start, 1)}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
