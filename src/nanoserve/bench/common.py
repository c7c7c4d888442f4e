"""What every `nanoserve bench` command shares: the workload (random token ids, or a ShareGPT file), Poisson
arrivals, percentiles, and the JSON record (machine, versions, date, commit, command line, figures).

Nothing here imports torch at module level: `nanoserve bench serve` clients are spawned processes that import
this module, and they should start in a fraction of a second.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)  # `vllm bench latency`'s


@dataclass
class BenchRequest:
    """One request of a workload: the prompt (text or token ids), its length in tokens, the tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def random_requests(rng: random.Random, count: int, input_len: int, output_len: int, vocab: int) -> list[BenchRequest]:
    """`count` prompts of `input_len` random token ids below `vocab` (no two share a prefix, in practice)."""
    if count < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"--num-prompts, --input-len and --output-len must be positive, got {count}, {input_len}, "
                         f"{output_len}")
    return [BenchRequest([rng.randrange(vocab) for _ in range(input_len)], input_len, output_len) for _ in range(count)]


def load_sharegpt(path: str | Path, tokenizer, count: int, output_len: int | None = None,
                  max_model_len: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """`count` requests from a ShareGPT-format JSON file (a list of {"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}): the prompt is the first human turn, the output length the tokenized length
    of the gpt reply that follows it (or `output_len`). Conversations are shuffled with `seed` (as `vllm bench`
    does); those without such a pair, or longer than max_model_len, are skipped."""
    if tokenizer is None:
        raise ValueError("--dataset-path needs the model's tokenizer (it was skipped: drop --skip-tokenizer-init)")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the dataset {str(path)!r}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{str(path)!r} is not a ShareGPT file: expected a JSON list of {{\"conversations\": [...]}}")
    entries = list(data)
    random.Random(seed).shuffle(entries)
    requests = []
    for entry in entries:
        pair = _first_exchange(entry)
        if pair is None:
            continue
        prompt_len = len(tokenizer.encode(pair[0]))
        out_len = output_len or len(tokenizer.encode(pair[1], add_special_tokens=False))
        if prompt_len < 1 or out_len < 1 or (max_model_len and prompt_len + out_len > max_model_len):
            continue
        requests.append(BenchRequest(pair[0], prompt_len, out_len))
        if len(requests) == count:
            return requests
    raise ValueError(f"{str(path)!r} has {len(requests)} usable conversations (a human turn, then a gpt reply"
                     f"{f', within max_model_len={max_model_len}' if max_model_len else ''}); --num-prompts asks "
                     f"for {count}")


def _first_exchange(entry) -> tuple[str, str] | None:
    """(first human turn, the gpt reply after it), or None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for first, second in zip(turns, turns[1:]):
        if not (isinstance(first, dict) and isinstance(second, dict)):
            return None
        if first.get("from") == "human" and second.get("from") == "gpt":
            prompt, reply = first.get("value"), second.get("value")
            return (prompt, reply) if isinstance(prompt, str) and isinstance(reply, str) and prompt else None
    return None


def arrival_offsets(count: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate, else a Poisson
    process (exponential gaps of mean 1 / request_rate, seeded), the first request at 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=max(count - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, linear between the two nearest ranks (numpy's default)."""
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution(values: list[float], scale: float = 1e3) -> dict | None:
    """mean / p50 (the median) / p99 / max, in ms by default, as `vllm bench serve` reports them."""
    if not values:
        return None
    ordered = sorted(v * scale for v in values)
    return {"mean": statistics.fmean(ordered), "p50": percentile(ordered, 50), "p99": percentile(ordered, 99),
            "max": ordered[-1]}


def environment() -> dict:
    """What a result must carry to be compared later: the machine, versions, date, commit and command line."""
    from nanoserve import __version__

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["nanoserve" if sys.argv[0].endswith(("nanoserve", "__main__.py")) else
                                   sys.argv[0], *sys.argv[1:]]),
            **_machine(), "python": platform.python_version(), "nanoserve": __version__, "git_commit": _git_commit()}
    for module in ("torch", "triton", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # not installed (triton on some CPU machines): recorded as absent
            info[module] = None
    return info


def _machine() -> dict:
    """The host, its CPU, and its GPUs (None / 0 without CUDA)."""
    machine = {"host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "gpu": None, "gpu_count": 0,
               "cuda": None}
    try:
        import torch

        if torch.cuda.is_available():
            machine.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                           cuda=torch.version.cuda)
    except ImportError:
        pass
    return machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def _git_commit() -> str | None:
    """The commit of the checkout nanoserve runs from, None for an installed wheel (or without git). NANOSERVE_GIT_COMMIT
    names it where the tree is a copy whose .git is not the sender's (a remote GPU machine)."""
    if os.environ.get("NANOSERVE_GIT_COMMIT"):
        return os.environ["NANOSERVE_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or None
    except Exception:
        return None


def write_json(path: str | Path, data: dict) -> Path:
    """Indented JSON; NaN and infinities become null (JSON has neither), other objects their str()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(data), indent=2) + "\n")
    return path


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


def release_memory() -> None:
    """After the last reference to an engine is dropped: collect it (graphs and pools die with it) and return
    the cached device memory, so the next engine starts from an empty allocator."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


__all__ = ["BenchRequest", "random_requests", "load_sharegpt", "arrival_offsets", "percentile", "distribution",
           "environment", "write_json", "release_memory", "PERCENTILES"]
