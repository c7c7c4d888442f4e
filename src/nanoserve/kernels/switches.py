"""On/off switches of the decode kernels: programmatic dependent launch, each fusion, and the tests' Triton path.

Read once from the environment at import (NANOSERVE_PDL=0 turns PDL off, NANOSERVE_GEMV_PREFETCH=0 the GEMV's L2
prefetch; NANOSERVE_FUSE_NORM=0 the RMSNorm prologue; NANOSERVE_GLUON_DECODE=0 the Gluon fp8 decode), so a benchmark
can measure each one's worth: kernels read SWITCHES when they launch, so `switched(pdl=False)` followed by a fresh
capture gives graphs without it, in the same process. Every switch only chooses between two paths
that compute the same result (the tests check each fused path against the unfused one).

force_triton (NANOSERVE_FORCE_TRITON=1) is for tests only: every kernel takes its Triton path whatever the device
and the GEMV tables say (_triton.use_triton), so CPU tests run the kernels in Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

_ENV = {"pdl": "NANOSERVE_PDL", "gemv_prefetch": "NANOSERVE_GEMV_PREFETCH",
        "fuse_norm": "NANOSERVE_FUSE_NORM", "gluon_decode": "NANOSERVE_GLUON_DECODE",
        "fuse_max_m": "NANOSERVE_FUSE_MAX_M", "fuse_norm_min_k": "NANOSERVE_FUSE_NORM_MIN_K",
        "fuse_norm_max_k": "NANOSERVE_FUSE_NORM_MAX_K", "force_triton": "NANOSERVE_FORCE_TRITON"}
_COUNTS = ("fuse_max_m", "fuse_norm_min_k", "fuse_norm_max_k")


@dataclass
class Switches:
    pdl: bool = True  # programmatic dependent launch between consecutive kernels (Hopper and newer)
    # The GEMV asks L2 for all its weight lines before the PDL wait, not only its first tile (several rows, matrices
    # up to gemv.PREFETCH_MAX_WEIGHT_BYTES): small models' steps are faster so
    # (measured: notes/PERF.md, issue 34 figures, switches.gemv_prefetch).
    gemv_prefetch: bool = True
    fuse_norm: bool = True  # residual add + RMSNorm in the prologue of the GEMV that follows
    gluon_decode: bool = True  # an fp8 cache's decode on Hopper by attention_sm90's Gluon kernel (else Triton's)
    # Rows up to which the fused prologues run. Each program of a prologue-fused GEMV re-reads (and re-normalises)
    # all its rows' activations, which is free for one row and costs as much as the weights by tens of rows
    # (measured: notes/PERF.md, issue 34 figures, switches.fuse_max_m).
    fuse_max_m: int = 1
    # The activation rows whose RMSNorm is fused, by width: every program of the GEMV recomputes the norm over the
    # whole row before its product. For Llama-3.1-8B's 4096 (3584 programs in gate_up) that costs more than the norm
    # kernel it saves; Qwen3-0.6B's 1024 gains; SmolLM2-135M's 576 loses, where each program's product is short and
    # the norm's two dependent reads sit after the PDL wait (measured: notes/PERF.md, issue 34 figures,
    # switches.fuse_norm_min_k).
    fuse_norm_min_k: int = 1024
    fuse_norm_max_k: int = 2048
    force_triton: bool = False  # tests: the Triton path on every device, GEMV tables bypassed (CPU: the interpreter)

    @classmethod
    def from_env(cls, environ=os.environ) -> "Switches":
        values = {}
        for name, var in _ENV.items():
            raw = environ.get(var)
            if raw is None:
                continue
            if name in _COUNTS:
                if not raw.isdigit():
                    raise ValueError(f"{var} must be a row count, got {raw!r}")
                values[name] = int(raw)
            elif raw not in ("0", "1"):
                raise ValueError(f"{var} must be 0 or 1, got {raw!r}")
            else:
                values[name] = raw == "1"
        return cls(**values)


SWITCHES = Switches.from_env()


@contextlib.contextmanager
def switched(**values: bool | int) -> Iterator[Switches]:
    """Temporarily set switches (tests, benchmarks); graphs captured inside keep what they captured."""
    unknown = set(values) - {f.name for f in dataclasses.fields(Switches)}
    if unknown:
        raise ValueError(f"unknown switches {sorted(unknown)}; known: {sorted(_ENV)}")
    before = dataclasses.asdict(SWITCHES)
    for name, value in values.items():
        setattr(SWITCHES, name, int(value) if name in _COUNTS else bool(value))
    try:
        yield SWITCHES
    finally:
        for name, value in before.items():
            setattr(SWITCHES, name, value)
