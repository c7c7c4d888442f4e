"""On/off switches of the decode kernels: programmatic dependent launch and each fusion.

Read once from the environment at import (NANOSERVE_PDL=0 turns PDL off; NANOSERVE_FUSE_NORM,
NANOSERVE_FUSE_SILU, NANOSERVE_FUSE_ROPE, NANOSERVE_FUSE_MERGE = 0 turn a fusion off), so a benchmark can measure each
one's worth: kernels read SWITCHES when they launch, so `switched(pdl=False)` followed by a fresh
capture gives graphs without it, in the same process. Every switch only chooses between two paths
that compute the same result (the tests check each fused path against the unfused one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

_ENV = {"pdl": "NANOSERVE_PDL", "fuse_norm": "NANOSERVE_FUSE_NORM", "fuse_silu": "NANOSERVE_FUSE_SILU",
        "fuse_rope": "NANOSERVE_FUSE_ROPE", "fuse_merge": "NANOSERVE_FUSE_MERGE"}


@dataclass
class Switches:
    pdl: bool = True  # programmatic dependent launch between consecutive kernels (Hopper and newer)
    fuse_norm: bool = True  # residual add + RMSNorm in the prologue of the GEMV that follows
    fuse_silu: bool = True  # SiLU-and-mul in the prologue of the down projection
    fuse_rope: bool = True  # q/k RMSNorm + RoPE + KV-cache store in the epilogue of the qkv GEMV
    fuse_merge: bool = True  # the split-K decode attention's merge in the prologue of the o_proj GEMV

    @classmethod
    def from_env(cls, environ=os.environ) -> "Switches":
        values = {}
        for name, var in _ENV.items():
            raw = environ.get(var)
            if raw is None:
                continue
            if raw not in ("0", "1"):
                raise ValueError(f"{var} must be 0 or 1, got {raw!r}")
            values[name] = raw == "1"
        return cls(**values)


SWITCHES = Switches.from_env()


@contextlib.contextmanager
def switched(**values: bool) -> Iterator[Switches]:
    """Temporarily set switches (tests, benchmarks); graphs captured inside keep what they captured."""
    unknown = set(values) - {f.name for f in dataclasses.fields(Switches)}
    if unknown:
        raise ValueError(f"unknown switches {sorted(unknown)}; known: {sorted(_ENV)}")
    before = dataclasses.asdict(SWITCHES)
    for name, value in values.items():
        setattr(SWITCHES, name, bool(value))
    try:
        yield SWITCHES
    finally:
        for name, value in before.items():
            setattr(SWITCHES, name, value)
