"""Engine configuration: one validated dataclass; unknown options are errors."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass
class EngineConfig:
    """Everything the engine needs to start. `model` is a local Hugging Face folder or a .gguf file.

    What each field means is said once, in FIELD_HELP below (the CLI's --help shows it with the default).
    """

    model: str
    device: str = "auto"  # "auto" → cuda when available, else cpu
    dtype: str = "auto"  # "auto" → the model's torch_dtype on CUDA, float32 on CPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None → max(8192, max_model_len)
    max_model_len: int | None = None  # None → the model's max_position_embeddings (capped at 32768)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None → sized from memory (GPU) or cpu_kv_cache_gb (CPU)
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gb: float = 1.0
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None  # None → 1, 2, 4, … ≤ max_num_seqs, plus max_num_seqs
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096  # the server answers 503 beyond this
    seed: int = 0
    tokenizer: str | None = None  # None → the model folder
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs carry no text
    load_format: str = "auto"  # "auto": safetensors weights; "dummy": random weights from config.json (benchmarks)
    show_progress: bool = True  # tqdm bars during capture

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(names - {'model'})}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available on this machine")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}")
        _positive("max_waiting_requests", self.max_waiting_requests)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
            if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {sizes}")
            if max(sizes) > self.max_num_seqs:
                raise ValueError(f"cudagraph_capture_sizes {sizes} exceed max_num_seqs={self.max_num_seqs}")
            self.cudagraph_capture_sizes = sorted(set(sizes))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def capture_sizes(self) -> list[int]:
        """Batch sizes that get a CUDA graph, ascending: powers of two up to max_num_seqs, plus max_num_seqs."""
        if self.cudagraph_capture_sizes is not None:
            return list(self.cudagraph_capture_sizes)
        return default_capture_sizes(self.max_num_seqs)

    def resolve(self, model_max_len: int, model_dtype: torch.dtype | None) -> None:
        """Fill the options that depend on the model (called once by the loader)."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, 32768)
        elif self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={model_max_len}"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        elif self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len={self.max_model_len} "
                "(a whole prompt is prefilled in one step)"
            )
        if self.dtype == "auto":
            on_cpu = self.device == "cpu"
            self.dtype = "float32" if on_cpu else _serving_dtype(model_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise RuntimeError("dtype is resolved when the model is loaded")
        return DTYPES[self.dtype]


# Help text of every EngineConfig field: `nanoserve ... --help` shows it (with the default), tests require one each.
FIELD_HELP = {
    "model": "a local Hugging Face model folder (config.json + safetensors) or a .gguf file",
    "device": "'cpu', 'cuda' or 'cuda:N'; 'auto' picks cuda when a GPU is visible, else cpu",
    "dtype": "float32, bfloat16 or float16 (fp32/bf16/fp16); 'auto' is the checkpoint's half type on CUDA "
             "(bfloat16 for float32 or quantized checkpoints) and float32 on CPU",
    "max_num_seqs": "most sequences decoded together in one step (the largest batch)",
    "max_num_batched_tokens": "most tokens one step may prefill; default: max(8192, max_model_len)",
    "max_model_len": "longest prompt + output, in tokens; default: the model's max_position_embeddings, "
                     "capped at 32768",
    "block_size": "tokens per KV-cache block (the page size of the paged cache)",
    "num_kv_blocks": "KV-cache blocks to allocate; default: sized from free GPU memory "
                     "(--gpu-memory-utilization) or from --cpu-kv-cache-gb on CPU",
    "gpu_memory_utilization": "fraction of the GPU's memory the engine may use in all (weights, KV cache, graphs)",
    "cpu_kv_cache_gb": "GiB of KV cache on CPU (at most what max_num_seqs full-length sequences need)",
    "enforce_eager": "decode without CUDA graphs (slower; for debugging and comparison)",
    "cudagraph_capture_sizes": "batch sizes that get a CUDA graph; default: 1, 2, 4, ... up to max_num_seqs, "
                               "plus max_num_seqs",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before",
    "max_waiting_requests": "most requests queued at once; the server answers 503 beyond this",
    "seed": "seed of the engine's random state (per-request seeds are in the sampling parameters)",
    "tokenizer": "a tokenizer folder or .gguf file other than the model's; default: the model's own",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids and outputs carry no text",
    "load_format": "'auto' reads the weights from the model; 'dummy' makes random weights of the model's shape "
                   "(benchmarks without weight files)",
    "show_progress": "show progress bars (CUDA-graph capture)",
}

def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def hf_config_dtype(hf_config) -> torch.dtype | None:
    """The checkpoint dtype a Hugging Face config declares (`dtype`, formerly `torch_dtype`), if any."""
    declared = vars(hf_config).get("dtype") or vars(hf_config).get("torch_dtype")
    if isinstance(declared, str):
        return DTYPES.get(DTYPE_ALIASES.get(declared, declared))
    return declared if isinstance(declared, torch.dtype) else None


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _serving_dtype(model_dtype: torch.dtype | None) -> str:
    """GPU default: the checkpoint's half type; float32 (or unknown) checkpoints serve in bfloat16, as in vLLM."""
    return "float16" if model_dtype == torch.float16 else "bfloat16"


__all__ = ["EngineConfig", "FIELD_HELP", "default_capture_sizes", "DTYPES"]
