"""One engine's tensor-parallel process group: the checks before any process starts, each rank's device, and
the rendezvous.

The group is a torch.distributed backend object built over a FileStore in a folder of the engine's own
(NCCL on CUDA, gloo on CPU), not torch's process-wide default group, so an engine owns its group and
closing it leaves nothing behind. NCCL's settings are left to the environment (the H200 machines keep
NVLink multicast off through NCCL_NVLS_ENABLE=0; nothing here turns it on).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.model.communicator import TensorParallel

# A collective waiting longer than this fails (a hung rank; a dead one is noticed at once). Start-up compiles
# kernels on every rank at the same time, so the ranks never wait on each other for long.
TIMEOUT = datetime.timedelta(minutes=5)


def check_world(config: EngineConfig) -> None:
    """ValueError, before any process starts, when this machine cannot run tensor_parallel_size ranks."""
    n = config.tensor_parallel_size
    if n == 1:
        return
    if not dist.is_available():
        raise ValueError(f"tensor_parallel_size={n} needs torch.distributed, which this torch build lacks")
    device = torch.device(config.device)
    if device.type == "cpu":
        if not dist.is_gloo_available():
            raise ValueError(f"tensor_parallel_size={n} on CPU needs torch.distributed's gloo backend, "
                             "which this torch build lacks")
        return
    if not dist.is_nccl_available():
        raise ValueError(f"tensor_parallel_size={n} on CUDA needs torch.distributed's NCCL backend, "
                         "which this torch build lacks")
    first, count = device.index or 0, torch.cuda.device_count()
    if first + n > count:
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (cuda:{first}..cuda:{first + n - 1}), but "
                         f"{count} {'is' if count == 1 else 'are'} visible")


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r runs on the r-th GPU after rank 0's (all ranks share the CPU)."""
    device = torch.device(config.device)
    return "cpu" if device.type == "cpu" else f"cuda:{(device.index or 0) + rank}"


def connect(store_path: str, rank: int, size: int, device: torch.device) -> TensorParallel:
    """Join the group (blocks until every rank has joined; NCCL connects at its first collective)."""
    store = dist.PrefixStore("nanoserve-tp", dist.FileStore(store_path, size))  # as init_process_group wraps it
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        options.is_high_priority_stream = False
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
    return TensorParallel(rank, size, group, device)


def disconnect(tp: TensorParallel, abort: bool = False) -> None:
    """Release the group; abort=True (a peer died) also cancels collectives still waiting on it, so a kernel
    blocked on a dead rank returns instead of hanging the device."""
    if tp.group is None:
        return
    close = getattr(tp.group, "abort" if abort else "shutdown", None)
    if close is not None:
        try:
            close()
        except RuntimeError:  # already torn down by the backend's own error handling
            pass
    tp.group = None
