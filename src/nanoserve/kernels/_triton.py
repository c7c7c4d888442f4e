"""What every kernel module shares: the Triton import guard and a few launch helpers, defined once.

triton is optional (CPU-only installs have none): `triton` / `tl` are then None, `jit` returns a
stand-in whose launch raises a clear error, and every entry point takes its plain-PyTorch path.
Whether an entry point runs its Triton kernel is use_triton's answer, the one place that rule lives. Off CUDA (the
tests' force_triton switch) the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the kernel modules
are imported, as tests/conftest.py does).

Programmatic dependent launch (PDL, Hopper and newer): a kernel launched with `launch_pdl=True` may
start while its predecessor in the stream is still running, once every program of the predecessor
called gdc_launch_dependents (or exited). Each kernel here that supports it takes a USE_PDL constexpr
(pdl_args gives it and the launch flag) and follows two rules:
  * before gdc_wait() it reads only what no kernel writes (weights, norm weights, the cos/sin table)
    and writes nothing; gdc_wait() returns once the predecessor has completed and its writes are
    visible, and every program calls it, so completion is transitive along the chain;
  * its first statement lets the next kernel launch (gdc_launch_dependents, pdl_start): the next kernel's
    programs are then scheduled as soon as every program of this one has started, and issue their weight loads
    while this one still waits or runs. (Triggering after the wait instead was measured slower:
    notes/PERF.md, issue 34 figures, _triton.)
    Correctness does not depend on where the trigger is: the next kernel still waits for this one to complete.
Kernels that are not PDL launches (cuBLAS, torch ops) wait for full completion as usual.
"""
from __future__ import annotations

import functools
import importlib

import torch

from nanoserve.kernels.switches import SWITCHES

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


def use_triton(x: torch.Tensor | torch.device) -> bool:
    """Whether a kernel entry point takes its Triton path for x (a tensor or its device): triton installed and x on
    CUDA, or the tests' force_triton switch on (then even without triton, so that a missing triton fails loudly)."""
    device = x if isinstance(x, torch.device) else x.device
    return SWITCHES.force_triton or (HAS_TRITON and device.type == "cuda")


def jit(fn=None, **kwargs):
    """triton.jit, or a stand-in that raises on launch when triton is missing."""
    if fn is None:
        return lambda f: jit(f, **kwargs)
    return triton.jit(fn, **kwargs) if HAS_TRITON else _MissingKernel(fn)


def _has_gdc() -> bool:
    """Whether this triton exposes grid-dependency control and the launch_pdl option (triton >= 3.4)."""
    if not HAS_TRITON:
        return False
    try:
        cuda = importlib.import_module("triton.language.extra.cuda")
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents") and \
        "launch_pdl" in CUDAOptions.__dataclass_fields__


HAS_GDC = _has_gdc()

if HAS_GDC:  # the wrappers keep `tl.extra.cuda` out of the kernels' own source

    @triton.jit
    def gdc_wait():
        tl.extra.cuda.gdc_wait()

    @triton.jit
    def gdc_launch_dependents():
        tl.extra.cuda.gdc_launch_dependents()

else:

    @jit
    def gdc_wait():
        pass

    @jit
    def gdc_launch_dependents():
        pass


@jit
def pdl_start(USE_PDL: tl.constexpr):
    """A PDL kernel's first statement: let the next kernel launch now."""
    if USE_PDL:
        gdc_launch_dependents()


@jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes (after the loads of what no kernel writes)."""
    if USE_PDL:
        gdc_wait()


@functools.cache
def _device_supports_pdl(device_index: int) -> bool:
    return HAS_GDC and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """PDL for launches on this device: switched on, a Hopper-or-newer GPU, a triton that has it."""
    if not SWITCHES.pdl or device.type != "cuda":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """Launch keywords: the kernel's USE_PDL constexpr and, when on, triton's launch_pdl flag."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


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
