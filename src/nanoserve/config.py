"""Engine configuration: one validated dataclass whose fields are the CLI flags; unknown options are errors.

A user's EngineConfig keeps what the user asked for ("auto" included). `resolve()` turns it, once the
model's limits are known, into a new EngineConfig of concrete values (an indexed device, a dtype, token
limits, each graph setting a GraphSizes) that the engine runs on; nothing mutates a config after construction.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.graph_sizes import GraphSizes, capture_sizes, default_capture_sizes, prefill_graph_sizes
from nanoserve.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # torch is imported where a value needs it: the CLI parses its flags without it
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # offline (LLM, generate, bench): throughput first
# `nanoserve serve`'s default: against the offline budget it cuts the ITL tail of streams decoding beside arriving
# prompts at little cost in output tok/s, where a smaller one cuts little more and costs more; 2048 is also the
# largest token-count graph (measured: notes/PERF.md, issue 34 figures, config.SERVE_MAX_NUM_BATCHED_TOKENS).
SERVE_MAX_NUM_BATCHED_TOKENS = 2048
# `nanoserve serve`'s chunk_time_ratio: a step that carries prompt tokens beside decode rows may take this many
# decode steps' time (measured curves): the value that keeps the ITL tail near the median without costing TTFT
# (measured: notes/PERF.md, issue 34 figures, config.SERVE_CHUNK_TIME_RATIO).
SERVE_CHUNK_TIME_RATIO = 4.0
# The EngineConfig fields whose `nanoserve serve` default differs (its --help shows these): a server's steps are
# sized for its streams' ITL, not throughput.
SERVE_DEFAULTS = {"max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS, "chunk_time_ratio": SERVE_CHUNK_TIME_RATIO}
MAX_DEFAULT_MODEL_LEN = 32768
# Token-count graphs ("auto"): planned among multiples of PREFILL_GRAPH_TOKEN_STEP up to this many tokens (and
# max_num_batched_tokens); a larger step runs eagerly. (Capping the offline budget here, so that every prompt step
# replays a graph, made one long prompt faster and nano-vllm's workload slower: notes/PERF.md, round 7.)
PREFILL_GRAPH_MAX_TOKENS = 2048
PREFILL_GRAPH_TOKEN_STEP = 16
# Planned ("auto") graphs: the capture time and graph-pool memory they may take (flags of the same names)
CUDAGRAPH_CAPTURE_BUDGET_S = 5.0
CUDAGRAPH_POOL_BUDGET_MIB = 1024
# Top logprobs a request may ask for per token (logprobs / prompt_logprobs; the sampler's buffers hold this many)
MAX_LOGPROBS = 20
QUANTIZATIONS = ("fp8",)  # weight formats model/quantization.py can make at load
# --kv-cache-dtype: "auto" keeps K/V in the serving dtype, "fp8" (alias "fp8_e4m3", as vLLM names it) stores float8
# e4m3 codes with scales of the --kv-cache-scales design: "token" (one per token and KV head, computed as K/V are
# stored), "layer" (one for K and one for V per layer: the checkpoint's, else 1.0), "auto" ("layer" when the
# checkpoint carries KV scales, else "token")
KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}
KV_CACHE_SCALES = ("auto", "token", "layer")
DEFAULT_BLOCK_SIZE = 16
# An fp8 cache's blocks hold 32 tokens: a kv head's run of a 16-token block is 2 KB of codes, which held both fp8
# decode kernels to 0.74-0.80 of the copy bandwidth; 32 lets the warp kernel reach 0.86-0.97 (H100; notes/PERF.md,
# round 8, ninth session).
FP8_BLOCK_SIZE = 32
# The side of the square weight tiles a block-scaled FP8 weight carries one scale for: what block-quantized
# checkpoints use (weight_block_size [128, 128]) and the only one the kernels take
FP8_BLOCK = 128

# `nanoserve serve` limits (flags of the same names): the drain on SIGTERM/SIGINT, then streams still open end
# with an error event; a request body not received in full by its deadline is answered 408 and its connection
# closed; more or longer stop strings than this are answered 400 (the API's stop matching is linear in the text
# either way: this bounds building it)
SHUTDOWN_TIMEOUT_S = 30.0
LOG_STATS_INTERVAL_S = 10.0  # the server's stats line (throughput, queue, KV cache, speculation), as vLLM's interval
REQUEST_BODY_TIMEOUT_S = 30.0
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
# --tool-call-parser: how `tool_choice: "auto"` outputs are read (server/tool_parsers.py); "auto": the parser the
# model's chat template calls for, "none": tool calls are left in the content
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
TOOL_CALL_PARSER_CHOICES = ("auto", "none", *TOOL_CALL_PARSERS)

# Structured outputs (engine/grammar.py): JSON may hold whitespace between tokens (as vLLM's default allows), at most
# this many characters in a row, so a small model cannot loop on blanks; compiled grammars kept per engine core
# (least recently used dropped); threads that compile them; a step's masks are filled on a thread of their own
# (beside the host's scheduling) from this many grammar rows: below it the hand-off costs more than the fill
# (measured: notes/PERF.md, issue 34 figures, config.GRAMMAR_FILL_THREAD_MIN_ROWS)
STRUCTURED_JSON_MAX_WHITESPACE = 16
GRAMMAR_CACHE_SIZE = 256


def _env_limit(name: str, default, kind=float):
    """A limit the environment variable `name` may lower or raise (read once, at import: a server and its engine core
    read the same; tests start servers with small limits this way); the default when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a {kind.__name__} value") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: must be positive")
    return value


# compiled grammars' memory: the cache holds at most this many bytes of them (least recently used dropped first),
# and a constraint whose compiled grammar alone is larger is refused (a 50k-value enum is ~180 MB over a 49k
# vocabulary); a constraint whose grammar is not compiled this many seconds after it reached the engine core
# (queueing for a thread included) is refused, the compile running on (xgrammar cannot be stopped)
GRAMMAR_CACHE_BYTES = 512 * 2**20
GRAMMAR_MAX_BYTES = _env_limit("NANOSERVE_GRAMMAR_MAX_BYTES", 64 * 2**20, int)
GRAMMAR_COMPILE_SECONDS = _env_limit("NANOSERVE_GRAMMAR_COMPILE_SECONDS", 10.0)
GRAMMAR_COMPILE_THREADS = 2
GRAMMAR_FILL_THREAD_MIN_ROWS = 8

# A request's output constraint is checked in the API process (server/constraint_check.py) on threads of its own, so
# that one client's schema cannot hold the threads other requests use, within a time budget (queueing included): a
# schema whose check outlasts it is answered 400 (a JSON-schema pattern like ^(ab|cd){1,5000}$ takes xgrammar 7-33 s;
# ordinary schemas, a 50k-value enum included, take well under 0.1 s)
CONSTRAINT_CHECK_THREADS = 2
CONSTRAINT_CHECK_TIMEOUT_S = 5.0
CONSTRAINT_CHECK_SLOW_KEPT = 256  # constraints that outlasted the budget, remembered (and refused at once)

# A hub id is resolved (hub.py) after one connection to the hub's host opens within this long; otherwise from the
# cache only: huggingface_hub would retry an unreachable hub five times with backoff (tens of seconds of warnings)
HUB_PROBE_TIMEOUT_S = 2.0


def _field(default=dataclasses.MISSING, *, help: str, unset: str | None = None):
    """An EngineConfig field with its --help text, said once here (the CLI adds "(default: X)"); unset: what a None
    default stands for, shown as the default."""
    return dataclasses.field(default=default, metadata={"help": help, "unset": unset})


@dataclass
class EngineConfig:
    """Everything the engine needs to start. `model` is a local Hugging Face folder or a .gguf file.

    What each field means is said once, in its own metadata (the CLI's --help shows it with the default).
    """

    model: str = _field(help="a local Hugging Face model folder (config.json + safetensors) or a .gguf file, or a "
                             "hub id (org/name; a GGUF repository's file as org/name:QUANT or org/name/FILE.gguf)")
    device: str = _field("auto", help="'cpu', 'cuda' or 'cuda:N'; 'auto' picks cuda when a GPU is visible, else cpu")
    dtype: str = _field("auto", help="float32, bfloat16 or float16 (fp32/bf16/fp16); 'auto' is the checkpoint's half "
                                     "type on CUDA (bfloat16 for float32 or quantized checkpoints) and float32 on CPU")
    tensor_parallel_size: int = _field(1, help="GPUs (or gloo processes on CPU) to shard the model over, "
                                               "Megatron-style; one worker process per extra rank (alias -tp)")
    max_num_seqs: int = _field(256, help="most sequences decoded together in one step (the largest batch)")
    max_num_batched_tokens: int | None = _field(
        None, help="tokens one step may run (decode rows + prefill chunks); a longer prompt is prefilled in chunks "
                   "over several steps; `serve` defaults to fewer (the ITL tail of streams decoding beside arriving "
                   "prompts)",
        unset=str(DEFAULT_MAX_NUM_BATCHED_TOKENS))
    max_model_len: int | None = _field(None, help="longest prompt + output, in tokens",
                                       unset=f"the model's max_position_embeddings, capped at {MAX_DEFAULT_MODEL_LEN}")
    block_size: int | None = _field(
        None, help=f"tokens per KV-cache block (the page size of the paged cache; {FP8_BLOCK_SIZE} with "
                   "--kv-cache-dtype fp8 unless given)", unset=str(DEFAULT_BLOCK_SIZE))
    num_kv_blocks: int | None = _field(None, help="KV-cache blocks to allocate",
                                       unset="sized from free GPU memory (--gpu-memory-utilization) or from "
                                             "--cpu-kv-cache-gb on CPU")
    gpu_memory_utilization: float = _field(0.90, help="fraction of the GPU's memory the engine may use in all "
                                                      "(weights, KV cache, graphs)")
    cpu_kv_cache_gb: float = _field(1.0, help="GiB of KV cache on CPU (at most what max_num_seqs full-length "
                                              "sequences need)")
    enforce_eager: bool = _field(False, help="decode without CUDA graphs (slower; for debugging and comparison)")
    # A resolved config holds a GraphSizes in both graph settings.
    cudagraph_capture_sizes: list[int] | str | GraphSizes = _field(
        "auto", help="batch sizes that get a CUDA graph: 'auto' plans them at start-up from measured replays (under "
                     "the two budgets below), 'pow2' is 1, 2, 4, ... plus max_num_seqs, or give sizes")
    prefill_graph_sizes: list[int] | str | GraphSizes = _field(
        "auto", help="token counts (prefill chunks + decode rows) that get a CUDA graph for prompt and mixed steps: "
                     f"'auto' plans them at start-up from measured replays (up to {PREFILL_GRAPH_MAX_TOKENS} tokens, "
                     "within the budgets below, shared with the decode graphs), 'off', or give sizes; a step over the "
                     "largest runs eagerly. Without CUDA, given sizes run the graphs' padded static-buffer forward "
                     "without capture (their eager twin, which the CPU tests check)")
    cudagraph_plan: str | None = _field(None, help="a batch-size histogram file: 'auto' plans for it when it exists; "
                                                   "the engine writes the sizes it saw there on shutdown")
    cudagraph_capture_budget_s: float = _field(CUDAGRAPH_CAPTURE_BUDGET_S,
                                               help="seconds the planned graphs may take to capture ('auto')")
    cudagraph_pool_budget_mib: int = _field(CUDAGRAPH_POOL_BUDGET_MIB,
                                            help="MiB of graph memory pool the planned graphs may take ('auto')")
    skip_graph_check: bool = _field(False, help="skip replaying every captured graph against the eager forward at "
                                                "start-up")
    enable_prefix_caching: bool = _field(True, help="reuse the KV blocks of a prompt prefix seen before")
    async_scheduling: bool = _field(True, help="schedule step N+1 while the device runs step N (false: one step at "
                                               "a time)")
    chunk_time_ratio: float = _field(
        0.0, help="cap the prompt tokens of a step that also decodes so that its time (the measured token-count "
                  "curve) is at most this many decode steps of its rows (the batch-size curve): the streams' ITL tail "
                  "beside arriving prompts; needs planned ('auto') CUDA graphs; 0: off")
    max_waiting_requests: int = _field(4096, help="most requests queued at once; the server answers 503 beyond this")
    seed: int = _field(0, help="seed of the engine's random state (per-request seeds are in the sampling parameters)")
    tokenizer: str | None = _field(None, help="a tokenizer folder or .gguf file (or hub id) other than the model's",
                                   unset="the model's own")
    revision: str | None = _field(None, help="for a hub id: the branch, tag or commit to use", unset="main")
    download_dir: str | None = _field(None, help="for a hub id: the cache folder to find or download it in "
                                                 "(HF_HUB_OFFLINE=1 uses only what is cached)",
                                      unset="huggingface_hub's cache, HF_HUB_CACHE")
    skip_tokenizer_init: bool = _field(False, help="load no tokenizer: prompts must be token ids and outputs carry "
                                                   "no text")
    load_format: str = _field("auto", help="'auto' reads the weights from the model; 'dummy' makes random weights of "
                                           "the model's shape (benchmarks without weight files)")
    quantization: str | None = _field(
        None, help="'fp8': linear weights stored as float8 e4m3 with one scale per output channel; on the GPU decode "
                   "is W8A8 from two rows up (the activations quantized to fp8 too) and W8A16 at one row, prefill W8A8 "
                   "through torch._scaled_mm; a pre-quantized FP8 checkpoint loads as stored either way",
        unset="none")
    quantize_lm_head: bool = _field(False, help="with quantization, the lm_head too (it stays in the serving dtype "
                                                "otherwise)")
    kv_cache_dtype: str = _field(
        "auto", help="the KV cache's storage: 'auto' is the serving dtype, 'fp8' (or 'fp8_e4m3') float8 e4m3 codes "
                     "with scales (--kv-cache-scales): half the bytes per token, so twice the cached tokens in the "
                     "same memory")
    kv_cache_scales: str = _field(
        "auto", help="with --kv-cache-dtype fp8, how K and V are scaled: 'token' (one scale per token and KV head, "
                     "computed as they are stored), 'layer' (one per layer for K and one for V: the checkpoint's "
                     "k_scale / v_scale, else 1.0), 'auto' (layer when the checkpoint carries KV scales, else token)")
    speculative_config: dict | str | None = _field(
        None, help="speculative decoding, as a JSON object with vLLM's names: {\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, \"prompt_lookup_min\": m} (drafts "
                   "copied from the request's own earlier tokens) or {\"method\": \"suffix\", ...} (drafts from "
                   "suffix statistics over the request and recent requests' outputs) or {\"method\": \"draft_model\", "
                   "\"model\": PATH, \"num_speculative_tokens\": k} (a smaller model with the same vocabulary "
                   "drafts greedily, on the device); verification is exact (greedy "
                   "and sampled outputs keep the model's distribution); \"adaptive\": false keeps k drafts every step",
        unset="off")
    show_progress: bool = _field(True, help="show progress bars (CUDA-graph capture)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(names - {'model'})}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if self.device.startswith("cuda") and not _torch().cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available on this machine")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        self._check_kv_cache()
        for name in ("max_num_seqs", "block_size", "max_waiting_requests", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}")
        if not (self.chunk_time_ratio == 0 or self.chunk_time_ratio >= 1):
            raise ValueError(f"chunk_time_ratio must be 0 (off) or >= 1, got {self.chunk_time_ratio}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in (None,) + QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs quantization='fp8'")
        spec = SpeculativeConfig.parse(self.speculative_config)
        self.speculative_config = spec.as_dict() if spec is not None else None
        if spec is not None and self.kv_cache_dtype == "fp8" and spec.num_speculative_tokens > self.block_size:
            raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens} with kv_cache_dtype='fp8' must be "
                             f"<= block_size={self.block_size} (a verification spans at most two blocks of the "
                             "cache's exact tail)")
        self.cudagraph_capture_sizes = capture_sizes(self.cudagraph_capture_sizes, self.max_num_seqs)
        self.prefill_graph_sizes = prefill_graph_sizes(self.prefill_graph_sizes)
        if not self.cudagraph_capture_budget_s > 0:
            raise ValueError(f"cudagraph_capture_budget_s must be > 0, got {self.cudagraph_capture_budget_s}")
        _positive("cudagraph_pool_budget_mib", self.cudagraph_pool_budget_mib)

    def _check_kv_cache(self) -> None:
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES + tuple(KV_CACHE_DTYPE_ALIASES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scales must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scales!r}")
        if self.kv_cache_scales != "auto" and self.kv_cache_dtype != "fp8":
            raise ValueError(f"kv_cache_scales={self.kv_cache_scales!r} needs kv_cache_dtype='fp8'")
        if self.block_size is None:
            self.block_size = FP8_BLOCK_SIZE if self.kv_cache_dtype == "fp8" else DEFAULT_BLOCK_SIZE

    def resolve(self, model_max_len: int, model_dtype: torch.dtype | None) -> "EngineConfig":
        """The concrete config the engine runs on: device indexed, dtype chosen, token limits filled in, both graph
        settings GraphSizes (false when that forward runs eagerly). Raises ValueError for limits the model cannot
        meet."""
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={model_max_len}")
        max_model_len = self.max_model_len or min(model_max_len, MAX_DEFAULT_MODEL_LEN)
        device = _resolve_device(self.device)
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else _serving_dtype(model_dtype)
        use_graphs = device.startswith("cuda") and not self.enforce_eager
        budget = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        return dataclasses.replace(
            self, device=device, dtype=dtype, max_model_len=max_model_len, max_num_batched_tokens=budget,
            cudagraph_capture_sizes=self._decode_graphs() if use_graphs else GraphSizes(),
            prefill_graph_sizes=self._token_graphs(use_graphs, budget, max_model_len))

    def _decode_graphs(self) -> GraphSizes:
        sizes = self.cudagraph_capture_sizes
        if isinstance(sizes, GraphSizes):
            return sizes
        if sizes == "auto":  # the plan always captures max_num_seqs
            return GraphSizes((), True, self.max_num_seqs)
        return GraphSizes.given(default_capture_sizes(self.max_num_seqs) if sizes == "pow2" else sizes)

    def _token_graphs(self, use_graphs: bool, budget: int, max_model_len: int) -> GraphSizes:
        """Given sizes also run without CUDA (the graphs' padded static-buffer forward, uncaptured); "auto" needs it."""
        sizes = self.prefill_graph_sizes
        if isinstance(sizes, GraphSizes):
            return sizes
        if isinstance(sizes, list) and sizes and sizes[-1] > budget:
            raise ValueError(f"prefill_graph_sizes {sizes} exceed max_num_batched_tokens={budget}")
        if sizes == "off" or self.enforce_eager or (sizes == "auto" and not use_graphs):
            return GraphSizes()
        if sizes == "auto":  # (no step holds more than max_num_seqs full sequences)
            return GraphSizes((), True, min(PREFILL_GRAPH_MAX_TOKENS, budget, self.max_num_seqs * max_model_len))
        return GraphSizes.given(sizes)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The checked speculative-decoding settings (None: off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def max_sampled_rows(self) -> int:
        """Most logit rows one step samples: a row per sequence, and per draft when verifying speculative drafts."""
        spec = self.speculative
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))

    @property
    def is_resolved(self) -> bool:
        return self.device != "auto" and self.dtype != "auto" and self.max_model_len is not None

    @property
    def torch_device(self) -> torch.device:
        self._require_resolved()
        return _torch().device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        self._require_resolved()
        return getattr(_torch(), self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: float8 e4m3 codes for an fp8 cache, else the serving dtype."""
        self._require_resolved()
        return _torch().float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype

    def _require_resolved(self) -> None:
        if not self.is_resolved:
            raise RuntimeError("this EngineConfig is not resolved yet: call resolve() with the model's limits")


# Each field's help, for code that wants one (the --model of commands without engine flags).
FIELD_HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineConfig)}


def hf_config_dtype(hf_config) -> torch.dtype | None:
    """The checkpoint dtype a Hugging Face config declares (`dtype`, formerly `torch_dtype`), if any."""
    torch = _torch()
    declared = vars(hf_config).get("dtype") or vars(hf_config).get("torch_dtype")
    if isinstance(declared, str):
        name = DTYPE_ALIASES.get(declared, declared)
        return getattr(torch, name) if name in DTYPE_NAMES else None
    return declared if isinstance(declared, torch.dtype) else None


def _torch():
    import torch

    return torch


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _resolve_device(device: str) -> str:
    """'auto' → cuda when available; 'cuda' → 'cuda:<current>' (graphs, pools and streams belong to one device)."""
    torch = _torch()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    return device


def _serving_dtype(model_dtype: torch.dtype | None) -> str:
    """GPU default: the checkpoint's half type; float32 (or unknown) checkpoints serve in bfloat16, as in vLLM."""
    return "float16" if model_dtype == _torch().float16 else "bfloat16"


__all__ = ["EngineConfig", "GraphSizes", "FIELD_HELP", "default_capture_sizes", "DTYPE_NAMES", "KV_CACHE_DTYPES",
           "KV_CACHE_SCALES"]
