"""What every kernel module shares: the Triton import guard and a few launch helpers, defined once.

triton is optional (CPU-only installs have none): `triton` / `tl` are then None, `jit` returns a
stand-in whose launch raises a clear error, and every entry point takes its plain-PyTorch path.
Off CUDA with triton installed, the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
before the kernel modules are imported, as tests/conftest.py does).
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRETER_SMS = 4  # the interpreter (CPU tensors) counts as a small GPU: few programs, quick tests


class _MissingKernel:
    """Stands in for a @triton.jit kernel when triton is not installed."""

    def __init__(self, fn):
        self.__name__ = fn.__name__

    def __getitem__(self, grid):
        raise RuntimeError(f"the Triton kernel {self.__name__} was requested but triton is not installed")


def jit(fn=None, **kwargs):
    """triton.jit, or a stand-in that raises on launch when triton is missing."""
    if fn is None:
        return lambda f: jit(f, **kwargs)
    return triton.jit(fn, **kwargs) if HAS_TRITON else _MissingKernel(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prev_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; off CUDA (the interpreter) a small GPU."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
