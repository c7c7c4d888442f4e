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
DECODE_B2B_STEPS = 50  # decode_steps' back-to-back steps per timing
DECODE_CONTEXT = 512  # the decode steps' context (tokens per row) in the targets of issues 35, 36 and 37
# The KV-cache formats issue 37's benchmarks compare, as engine options: the model dtype ("auto"), fp8 with a scale per
# token and KV head, fp8 with one scale per layer (1.0 without checkpoint scales: vLLM's uncalibrated default)
KV_SETTINGS = {"auto": {}, "fp8": {"kv_cache_dtype": "fp8", "kv_cache_scales": "token"},
               "fp8-layer": {"kv_cache_dtype": "fp8", "kv_cache_scales": "layer"}}


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
    """Parameters of a decoder (Llama and the other dense families, and the mixtures of experts) by role."""

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
    def _lookup_only(self) -> int:
        """The embedding when only looked up (an untied one); a tied one is also the head every row multiplies by."""
        return self.embedding if self.lm_head else 0

    @property
    def active(self) -> int:
        """What one token multiplies by: every weight but the unselected experts (and an untied embedding, a lookup)."""
        return self.total - self._lookup_only - self.sparse_layers * (self.num_experts - self.top_k) * self.expert

    def decode_read(self, rows: int) -> int:
        """Parameters a decode step of `rows` rows reads: all but an untied embedding (rows of it only), and of
        each MoE layer's experts the expected number that `rows` tokens select, uniform routing:
        E · (1 − (1 − k/E)^rows)."""
        if not self.num_experts:
            return self.total - self._lookup_only
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** rows)
        return round(self.total - self._lookup_only - self.sparse_layers * (self.num_experts - touched) * self.expert)


def check(value: float | None, limit: float, at_least: bool = False) -> dict:
    """A target read off a result: its value, limit and whether it holds (value <= limit, or >= with at_least; None
    where not measured)."""
    met = None if value is None else (value >= limit if at_least else value <= limit)
    return {"value": value, "limit": limit, "met": met}


def text_part(cfg: dict) -> dict:
    """The text model's config: a multimodal config's text_config (Gemma 3), else the config itself."""
    return cfg.get("text_config") or cfg


def model_spec(cfg: dict):
    """The engine's ModelSpec of a config dict (transformers' config class fills the defaults the file omits, e.g.
    Gemma's tied embeddings and its layer types from sliding_window_pattern)."""
    from transformers import AutoConfig

    from nanoserve.model_spec import ModelSpec

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    return ModelSpec.from_hf_config(AutoConfig.for_model(cfg.get("model_type", "llama"), **fields))


def head_dim(cfg: dict) -> int:
    cfg = text_part(cfg)
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


_NORMS_PER_LAYER = {"pre": 2, "sandwich": 4, "post": 2}  # model_spec.Family.norms: RMSNorms of hidden_size a layer


def param_counts(cfg: dict) -> ParamCounts:
    """Weights from a HF config (a multimodal one's text model only): q/k/v/o (+ their biases as ModelSpec reads
    them), q/k RMSNorm (per head: Qwen3, Gemma 3; over the projection: OLMo-2), gate/up/down, the layer's RMSNorms
    (two; Gemma's four), final norm, embedding, untied lm_head. Phi-3's fused projections count the same."""
    spec = model_spec(cfg)
    h, inter, vocab, d = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if spec.qkv_bias else 0) + (h if spec.o_bias else 0)
    attn += {"head": 2 * d, "projection": q + kv, None: 0}[spec.qk_norm]
    norms = _NORMS_PER_LAYER[spec.family.norms] * h
    mlp = 3 * h * inter + (2 * inter + h if spec.mlp_bias else 0)
    per_layer = attn + mlp + norms
    embedding, lm_head = vocab * h, 0 if spec.tie_word_embeddings else vocab * h
    layers = spec.num_layers
    moe = _moe_counts(text_part(cfg), h, layers)
    if moe is None:
        return ParamCounts(per_layer=per_layer, layers=per_layer * layers, final_norm=h, embedding=embedding,
                           lm_head=lm_head)
    expert, experts, top_k, sparse, shared = moe
    sparse_layer = attn + norms + experts * (expert + h) + (3 * h * shared + h if shared else 0)  # + the router
    return ParamCounts(per_layer=per_layer, layers=per_layer * (layers - sparse) + sparse_layer * sparse, final_norm=h,
                       embedding=embedding, lm_head=lm_head, expert=expert, num_experts=experts, top_k=top_k,
                       sparse_layers=sparse)


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


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2, scales: str | None = None) -> int:
    """K and V of one token across all layers (the engine's KVCacheSpec, for a config not yet loaded): dtype_bytes 1
    is an fp8 cache, whose `scales` ("token" or "layer", as KV_SETTINGS name them) the spec counts too."""
    import torch

    from nanoserve.runner.kv_cache import KVCacheSpec

    text = text_part(cfg)
    nkv = text.get("num_key_value_heads", text["num_attention_heads"])
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    return KVCacheSpec(text["num_hidden_layers"], nkv, head_dim(cfg), 1, dtype, scales).bytes_per_token


def kv_bytes_read(cfg: dict, context: int, dtype_bytes: int = 2, scales: str | None = None) -> int:
    """K/V bytes one decode row at `context` tokens reads: min(context, window) tokens on a sliding-window layer,
    all of them on a full-attention one (the windows as the engine reads them: ModelSpec.window)."""
    spec = model_spec(cfg)
    per_layer_token = kv_bytes_per_token(cfg, dtype_bytes, scales) // spec.num_layers
    return per_layer_token * sum(min(context, spec.window(i) or context) for i in range(spec.num_layers))


def start_engine(model_dir: str, max_num_seqs: int, max_model_len: int = 4096, **engine_options):
    """An LLM on a dummy-weight model folder, and its start-up record (wall time, graph captures, KV blocks and the
    cache's bytes per token); engine_options: more EngineConfig fields (kv_cache_dtype, graph sizes, ...)."""
    import time

    from nanoserve import LLM

    start = time.perf_counter()
    options = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, show_progress=False)
    llm = LLM(model_dir, **{**options, **engine_options})
    wall = time.perf_counter() - start
    runner = llm.engine.core.runner
    capture = {kind.name.lower(): {"capture_s": gr.capture_seconds, "wall_s": gr.wall_seconds,
                                   "sizes": list(gr.capture_sizes)} for kind, gr in runner.graphs.runners.items()}
    return llm, {"engine_start_s": wall, "capture_s": runner.graphs.capture_seconds, "graphs": capture,
                 "kv_blocks": runner.info.num_kv_blocks, "kv_block_size": runner.kv.block_size,
                 "kv_tokens": runner.info.num_kv_blocks * runner.kv.block_size,
                 "kv_bytes_per_token": runner.kv.bytes_per_token}


def decode_steps(llm, counts: ParamCounts, cfg: dict, rows_list: list[int], bandwidth: float,
                 context: int = DECODE_CONTEXT, weight_bytes: int | None = None) -> dict:
    """The engine's decode step (ModelRunner.execute of a forward-only batch: the graph replay the engine runs) at
    `context` tokens a row, per row count: ms against its floor (the weights the rows read, bf16
    ParamCounts.decode_read or `weight_bytes` (fp8 weights), and the K/V they read, kv_bytes_read in the engine's own
    cache format, at `bandwidth`), with one profiled step's kinds. step_ms: steps launched back to back, as the
    asynchronous engine runs them (its host work for step N+1 overlaps step N on the device); step_sync_ms: the median
    of steps launched and waited for one at a time, which also counts the host's launch work (up to ~0.6 ms at 16
    rows of 8k contexts: notes/PERF.md, issue 36, second attempt) — the figure these benchmarks reported before."""
    import statistics

    from nanoserve.bench.decode_step import decode_batch, time_decode_step
    from nanoserve.bench.profile import kind_table, profile_step

    runner = llm.engine.core.runner
    kv_row = kv_bytes_read(cfg, context, runner.kv.dtype.itemsize, runner.kv.scales)
    out = {}
    for rows in rows_list:
        batch = decode_batch(runner, rows, context)
        times = time_decode_step(runner, batch, warmup=5, iters=30)
        step_ms = 1e3 * back_to_back_seconds(lambda: runner.execute(batch), DECODE_B2B_STEPS) / DECODE_B2B_STEPS
        floor_bytes = (2 * counts.decode_read(rows) if weight_bytes is None else weight_bytes) + kv_row * rows
        floor_ms = 1e3 * floor_bytes / bandwidth
        table = kind_table(profile_step(lambda: runner.execute(batch)))
        out[str(rows)] = {"step_ms": step_ms, "step_sync_ms": statistics.median(times), "min_sync_ms": min(times),
                          "floor_ms": floor_ms, "floor_bytes": floor_bytes, "kv_bytes": kv_row * rows,
                          "context": context, "profile": table}
        top = sorted(table["kinds"].items(), key=lambda kv: -kv[1]["busy_us"])[:4]
        print(f"  decode b={rows:3d} at {context}: {step_ms:7.3f} ms (one at a time {statistics.median(times):.3f}; "
              f"floor {floor_ms:.3f} ms, {step_ms / floor_ms:.2f}x); "
              + ", ".join(f"{kind} {row['busy_us']:.0f} us" for kind, row in top)
              + f" of {table['busy_us']:.0f} us busy", flush=True)
    return out


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


class Relaunched:
    """A Triton or Gluon kernel launched with extra compile options (num_warps, maxnreg, ...): put in place of the
    module's name, it lets a sweep try launch parameters the module fixes. `compiled` (a dict) gets the launched
    kernel's registers, spills and shared memory."""

    def __init__(self, kernel, compiled: dict | None = None, **options):
        self.kernel, self.compiled, self.options = kernel, compiled, options

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            done = self.kernel[grid](*args, **{**kwargs, **self.options})
            if self.compiled is not None:
                self.compiled.update(registers=getattr(done, "n_regs", None), spills=getattr(done, "n_spills", None),
                                     shared_bytes=getattr(getattr(done, "metadata", None), "shared", None))
            return done
        return launch
