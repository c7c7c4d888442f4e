"""Few-row products for decode: out = x @ W.T (+ bias) for M = 1..64 rows, as ONE Triton kernel, and the
one place that decides which kernel a linear layer runs (choose(): GEMV_SHAPES by shape, else GEMV_TABLE by size).

At decode every linear layer multiplies M = batch-size rows by a weight W [N, K] that is read once
from HBM, so its time is bytes(W) / bandwidth plus a fixed latency. cuBLAS's tiles are made for large
M: on mid-size matrices at M = 1 it reaches a third of HBM bandwidth, and where it splits K it
launches a second reduce kernel, which inside a CUDA graph costs another launch gap.

The kernel (`_gemv_kernel`):
  * grid (cdiv(N, BLOCK_N), SPLIT_K): program (n, s) computes out[:, n*BLOCK_N : (n+1)*BLOCK_N]
    over the s-th slice of K, for all M rows at once, so W is read exactly once;
  * per iteration a [BLOCK_N, BLOCK_K] weight tile is read along K (W is row-major, so a thread
    reads 16 contiguous bytes) and the loop is software-pipelined (`tl.range(num_stages=...)`:
    cp.async into shared memory), so several tiles per program are in flight;
  * the product is accumulated in fp32: for few rows by broadcast-multiply on CUDA cores ("fma";
    with M = 1 the sum over K is deferred to the end of the loop), for more by `tl.dot` on tensor
    cores ("dot", M padded to 16..64: the padding is free, the kernel is bound by the weight bytes);
  * split-K without a second launch: when N / BLOCK_N programs cannot fill the GPU, K is split.
    Each program stores its fp32 partial into a workspace and increments a per-tile counter
    (release/acquire atomics); the program that sees it was the last one sums the partials in
    split order (so the result is deterministic), adds the bias, writes the output, and resets
    the counter to 0. The counters live in a small persistent int32 buffer per device, zeroed
    once, which is therefore zero again after every call and every CUDA-graph replay;
  * a prologue transforms x as it is loaded, so the op before the product needs no launch of its
    own: residual add + RMSNorm (norm_linear; every program first takes the rows' norms over all of
    K). (A SiLU-and-mul prologue for the down projection was measured slower than the separate kernel and
    removed: notes/PERF.md, issue 34 figures, gemv.);
  * with programmatic dependent launch (see _triton.py) each program loads its first weight tile
    before gdc_wait, so the weights stream while the previous kernel finishes;
  * FP8 weights (kernels/fp8.py), W8A8 ("dot8q"): x arrives as e4m3 codes with a scale per row and 128 columns
    (fp8.Fp8Rows, written by the kernel that produces x), both tiles go to the FP8 tensor cores as they are, and
    each tile's fp32 product is scaled by its rows' x scales (and the weight's block scales) before it is summed;
  * FP8 weights, W8A16 ("fma"): the tile is read as float8_e4m3fn (half the bytes), converted to
    the activation dtype in registers, accumulated in fp32 like the rest, and each output is multiplied
    by its channel's fp32 scale once, before the bias (and before the split-K sum is stored); with the
    128x128-block scales of block-quantized checkpoints (fp8.BLOCK) each weight is scaled in fp32 as its
    tile is converted instead. FP8 weights have a dispatch table of their own (FP8_GEMV_TABLE): a tile of
    the same bytes spans twice the K.

Everything is CUDA-graph capturable: no host syncs, fixed-size allocations only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels import fp8, fused
from nanoserve.kernels.fp8 import SCALE_GROUP_K
from nanoserve.kernels._triton import (HAS_TRITON, cdiv, jit, next_power_of_2, num_sms, pdl_args, pdl_enabled,
                                       pdl_start, pdl_wait, prev_power_of_2, tl, use_triton)
from nanoserve.kernels.rotary_kv import QKVRope
from nanoserve.kernels.switches import SWITCHES

MAX_M = 64  # rows handled by the kernel; more rows are a GEMM, left to cuBLAS
FMA_MAX_ROWS = 16  # the fma path unrolls over rows; beyond this only tl.dot
MAX_SPLIT_K = 16
COUNTER_SLOTS = 8192  # output tiles that can be split-K'd in one call (one int32 counter each)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # activations; the weight is the same type, or fp8 with a scale
NORM_CHUNK = 4096  # elements of the [BLOCK_M, chunk] tile the RMSNorm prologue sums per step
PIPELINE_SMEM_BYTES = 128 * 2**10  # shared memory the pipelined tiles may take (an H100/H200 SM has 227 KiB)
ACT_FP8_MIN_K = 32  # an fp8 tensor-core product spans 32 values of K


@dataclass(frozen=True)
class GemvConfig:
    """One kernel variant. split_k is derived from programs_per_sm unless given explicitly."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    programs_per_sm: float = 2.0  # split K until the grid has about this many programs per SM; 0: never
    split_k: int | None = None
    act_fp8: bool = False  # W8A8: x comes quantized (fp8.Fp8Rows, from the kernel that produces it), the product
    # on the FP8 tensor cores. (x quantized per tile inside the GEMV instead was measured slower for every product
    # and row count: notes/PERF.md, issue 34 figures, gemv.GemvConfig.act_fp8.)

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"tl.dot needs block_n and block_k >= 16, got {self.block_n}, {self.block_k}")
        if self.num_stages < 1 or (self.split_k is not None and self.split_k < 1):
            raise ValueError(f"num_stages and split_k must be >= 1, got {self.num_stages}, {self.split_k}")
        if self.act_fp8 and not (self.use_dot and ACT_FP8_MIN_K <= self.block_k <= fp8.BLOCK):
            raise ValueError(f"act_fp8 (W8A8) is a tl.dot path with block_k {ACT_FP8_MIN_K}..{fp8.BLOCK} (a tile inside "
                             f"one activation and weight scale block), got {self.short()}")

    def short(self) -> str:
        """A compact name for tables: path, tile, warps, stages and the split rule (parse() reads it back)."""
        split = f"s{self.split_k}" if self.split_k is not None else f"p{self.programs_per_sm:g}"
        kind = "dot8q" if self.act_fp8 else "dot" if self.use_dot else "fma"
        return f"{kind} {self.block_n}x{self.block_k} w{self.num_warps} st{self.num_stages} {split}"

    @classmethod
    def parse(cls, short: str) -> "GemvConfig":
        """The config named by short(), e.g. 'fma 8x512 w4 st3 p0', 'dot 32x256 w4 st3 s4' or (W8A8)
        'dot8q 128x128 w4 st4 p1'."""
        try:
            kind, tile, warps, stages, split = short.split()
            block_n, block_k = (int(v) for v in tile.split("x"))
            if kind not in ("fma", "dot", "dot8q") or warps[0] != "w" or stages[:2] != "st" \
                    or split[0] not in "ps":
                raise ValueError(short)
            rule = {"split_k": int(split[1:])} if split[0] == "s" else {"programs_per_sm": float(split[1:])}
            return cls(block_n, block_k, int(warps[1:]), int(stages[2:]), kind != "fma", **rule,
                       act_fp8=kind == "dot8q")
        except ValueError:
            raise ValueError(f"bad GEMV config {short!r}: expected e.g. 'fma 8x512 w4 st3 p0'") from None


# -- the dispatch rule ---------------------------------------------------------------------------------
TRITON, CUBLAS = "triton", "cublas"
# rows bucket (the smallest key >= M) → ((weight MiB up to, None = any; the best Triton variant there; the
# faster of triton / cublas for the plain product), ...). The Triton variant also runs the fused prologue and
# epilogue paths, which cuBLAS cannot. `python benchmarks/gemv.py` on the H200 prints this dict to paste.
# From the H200 sweep of 2026-12-01 with PDL (benchmarks/results/gemv_sweep_h200.json: Qwen3-0.6B, Llama-3.1-8B
# and SmolLM2-135M decode matrices, M = 1..64; the table's variants are x1.02 of cuBLAS in geomean, x1.05 with PDL).
GEMV_TABLE: dict[int, tuple[tuple[float | None, str, str], ...]] = {
    1: (
        (2.4, 'fma 4x1024 w4 st3 p0', TRITON),
        (4.9, 'fma 8x1024 w4 st2 p0', TRITON),
        (6.9, 'fma 4x1024 w4 st3 p0', TRITON),
        (9.8, 'fma 8x1024 w4 st2 p0', TRITON),
        (19.6, 'fma 8x512 w4 st3 p0', TRITON),
        (39.2, 'fma 8x1024 w4 st2 p0', TRITON),
        (50.9, 'fma 4x1024 w4 st3 p0', TRITON),
        (77.8, 'fma 16x256 w4 st4 p0', CUBLAS),
        (257.8, 'fma 8x1024 w4 st2 p0', TRITON),
        (None, 'fma 16x256 w4 st4 p0', TRITON),
    ),
    2: (
        (2.4, 'fma 4x1024 w4 st3 p0', TRITON),
        (3.7, 'dot 64x128 w4 st4 p0', TRITON),
        (6.9, 'fma 4x1024 w4 st3 p0', TRITON),
        (50.9, 'dot 64x128 w4 st4 p0', TRITON),
        (77.8, 'dot 64x128 w4 st4 p1', CUBLAS),
        (257.8, 'dot 32x256 w4 st3 p1', CUBLAS),
        (None, 'dot 64x128 w4 st4 p0', TRITON),
    ),
    4: (
        (1.3, 'fma 8x1024 w4 st2 p0', TRITON),
        (2.4, 'dot 32x256 w4 st3 p1', TRITON),
        (3.7, 'dot 64x128 w4 st4 p0', TRITON),
        (4.9, 'dot 32x256 w4 st3 p1', TRITON),
        (6.9, 'dot 64x256 w4 st3 p1', TRITON),
        (50.9, 'dot 64x128 w4 st4 p0', TRITON),
        (77.8, 'dot 64x128 w4 st4 p1', CUBLAS),
        (545.3, 'dot 32x256 w4 st3 p1', CUBLAS),
        (None, 'dot 64x128 w4 st4 p0', TRITON),
    ),
    8: (
        (1.3, 'dot 64x128 w4 st4 p0', TRITON),
        (2.4, 'dot 32x256 w4 st3 p1', TRITON),
        (3.7, 'dot 64x128 w4 st4 p0', TRITON),
        (4.9, 'dot 32x256 w4 st3 p1', TRITON),
        (6.9, 'dot 64x256 w4 st3 p1', TRITON),
        (50.9, 'dot 64x128 w4 st4 p0', TRITON),
        (77.8, 'dot 64x128 w4 st4 p0', CUBLAS),
        (158.4, 'dot 32x256 w4 st3 p1', CUBLAS),
        (545.3, 'dot 64x128 w4 st4 p0', CUBLAS),
        (None, 'dot 64x128 w4 st4 p0', TRITON),
    ),
    16: (
        (1.3, 'dot 64x128 w4 st4 p0', TRITON),
        (2.4, 'dot 32x256 w4 st3 p1', TRITON),
        (3.7, 'dot 64x128 w4 st4 p0', TRITON),
        (6.9, 'dot 32x256 w4 st3 p1', TRITON),
        (50.9, 'dot 64x128 w4 st4 p0', TRITON),
        (77.8, 'dot 64x128 w4 st4 p1', CUBLAS),
        (158.4, 'dot 32x256 w4 st3 p1', CUBLAS),
        (257.8, 'dot 64x128 w4 st4 p1', TRITON),
        (None, 'dot 64x128 w4 st4 p0', CUBLAS),
    ),
    32: (
        (1.3, 'dot 64x128 w4 st4 p0', TRITON),
        (2.4, 'dot 32x256 w4 st3 p1', TRITON),
        (3.7, 'dot 64x128 w4 st4 p0', TRITON),
        (6.9, 'dot 32x256 w4 st3 p1', TRITON),
        (39.2, 'dot 64x128 w4 st4 p0', TRITON),
        (50.9, 'dot 64x128 w4 st4 p0', CUBLAS),
        (77.8, 'dot 128x128 w8 st3 p0', CUBLAS),
        (158.4, 'dot 32x256 w4 st3 p2', CUBLAS),
        (None, 'dot 128x128 w8 st3 p0', CUBLAS),
    ),
    64: (
        (1.3, 'dot 64x128 w4 st4 p0', CUBLAS),
        (2.4, 'dot 16x512 w4 st3 p1', TRITON),
        (3.7, 'dot 64x128 w4 st4 p0', TRITON),
        (4.9, 'dot 16x512 w4 st3 p2', CUBLAS),
        (6.9, 'dot 64x256 w4 st3 p1', CUBLAS),
        (19.6, 'dot 64x128 w4 st4 p0', TRITON),
        (50.9, 'dot 64x128 w4 st4 p0', CUBLAS),
        (77.8, 'dot 128x128 w8 st3 p0', CUBLAS),
        (None, 'dot 64x128 w4 st4 p1', CUBLAS),
    ),
}
# FP8 weights (element size 1): the same rule; "dot8q" variants are W8A8 (the kernel before the product writes x as
# e4m3 codes + a scale per token and 128 columns: the RMSNorm, the SiLU-mul, or fp8.quantize_activations for the
# attention output; the product on FP8 tensor cores), "fma" W8A16 (the weight converted in registers). From the H200
# sweep in the model (benchmarks/results/experiments/fp8_sweep_{llama,qwen3}_h200.json: each product's candidates
# with the rest as the table then said, `decode_floor.py model --quantization fp8 --gemv-rows 1 8 32 64`): W8A8
# wins every product from 2 rows up. _scaled_mm (CUBLAS) wins Llama's o_proj at 64 rows. Rows 1 and 8 re-swept in
# the model on 2026-12-03 with more candidates (experiments/fp8_sweep_llama_rows1_8_h200.json): fma 4x1024 st4 for
# Llama's o and gate_up at one row, dot8q 64x128 p4 for its down at 8 rows (step times:
# notes/PERF.md, issue 34 figures, gemv.FP8_GEMV_TABLE).
FP8_GEMV_TABLE: dict[int, tuple[tuple[float | None, str, str], ...]] = {
    1: (
        (3.0, 'fma 8x1024 w4 st3 p0', TRITON),
        (6.0, 'fma 16x512 w4 st4 p0', TRITON),
        (16.0, 'fma 4x1024 w4 st4 p0', TRITON),
        (24.0, 'fma 16x512 w4 st4 p0', TRITON),
        (56.0, 'fma 8x1024 w4 st3 p0', TRITON),
        (None, 'fma 4x1024 w4 st4 p0', TRITON),
    ),
    8: (
        (2.0, 'dot8q 64x128 w4 st4 p1', TRITON),
        (4.0, 'dot8q 64x128 w4 st6 p2', TRITON),
        (6.0, 'dot8q 64x128 w4 st4 p1', TRITON),
        (16.0, 'dot8q 128x128 w4 st4 p1', TRITON),
        (24.0, 'dot8q 64x128 w4 st6 p2', TRITON),
        (56.0, 'dot8q 64x128 w4 st4 p4', TRITON),
        (None, 'dot8q 128x128 w4 st4 p1', TRITON),
    ),
    32: (
        (2.0, 'dot8q 64x128 w4 st4 p1', TRITON),
        (3.0, 'dot8q 64x128 w4 st6 p2', TRITON),
        (4.0, 'dot8q 128x128 w8 st3 p1', TRITON),
        (6.0, 'dot8q 256x128 w8 st3 p1', TRITON),
        (16.0, 'dot8q 64x128 w4 st6 p2', TRITON),
        (24.0, 'dot8q 128x128 w8 st3 p1', TRITON),
        (56.0, 'dot8q 64x128 w4 st6 p2', TRITON),
        (None, 'dot8q 128x128 w8 st3 p1', TRITON),
    ),
    64: (
        (3.0, 'dot8q 64x128 w4 st4 p1', TRITON),
        (4.0, 'dot8q 128x128 w8 st3 p1', TRITON),
        (6.0, 'dot8q 64x128 w4 st4 p1', TRITON),
        (16.0, 'dot8q 128x128 w4 st4 p1', CUBLAS),
        (24.0, 'dot8q 64x128 w4 st4 p1', TRITON),
        (None, 'dot8q 128x128 w4 st4 p1', TRITON),
    ),
}



# Products whose best variant the size rule above misses, measured in the model where its shape runs: (rows bucket, N,
# K) → (variant, triton | cublas). A shape of the same bytes can want another tile: hidden 2560 (Gemma 3) is not a
# multiple of 1024, so a 1024-wide tile masks its last loads; a weight of 2560 rows gives a 64-row tile only 40
# programs, which K splits must fill. From the in-model sweeps of Gemma-3-4B's decode graphs on the H200
# (benchmarks/results/gemv_sweep_gemma3_*_h200.json: `decode_floor.py model --models gemma-3-4b --gemv-rows 1 16`).
GEMV_SHAPES: dict[tuple[int, int, int], tuple[str, str]] = {
    (1, 2560, 2048): ('fma 2x1024 w4 st2 p0', TRITON),
    (1, 20480, 2560): ('fma 4x512 w2 st3 p0', TRITON),
    (1, 2560, 10240): ('fma 2x1024 w4 st2 p0', TRITON),
    (16, 20480, 2560): ('dot 64x64 w4 st4 p2', TRITON),
    (16, 2560, 10240): ('dot 64x128 w4 st4 p1', TRITON),
    # Llama-3.1-8B's gate_up at 5-8 rows (a b = 1 verification of 4 drafts): the Triton tile over cuBLAS, 4.679 ->
    # 4.536 ms a step (benchmarks/results/gemv_rows8_llama_8e522b3_h200.json: `decode_floor.py model --models
    # llama-3.1-8b --gemv-rows 8`; no other product gained).
    (8, 28672, 4096): ('dot 64x128 w4 st4 p0', TRITON),
    # and its qkv, o and down there: 6 stages in flight (the most PIPELINE_SMEM_BYTES holds) over 4, 5.931 -> 5.841
    # ms the 5-row step on an H100 (benchmarks/results/gemv_rows5_llama_14f6042_h100.json: `decode_floor.py model
    # --models llama-3.1-8b --batch-sizes 1 5 --gemv-rows 5`; cuBLAS's down before)
    (8, 6144, 4096): ('dot 64x128 w4 st6 p0', TRITON),
    (8, 4096, 4096): ('dot 64x128 w4 st6 p0', TRITON),
    (8, 4096, 14336): ('dot 64x128 w4 st6 p0', TRITON),
    # SmolLM2-135M's down projection at 5 rows (its b = 1 verification of 4 drafts): the unsplit tile over the size
    # rule's split one, 0.696 -> 0.638 ms the step (benchmarks/results/gemv_rows5_smollm2_8eb6148_h200.json:
    # `decode_floor.py model --models smollm2-135m --gemv-rows 5`; its other products keep the rule's tile)
    (8, 576, 1536): ('dot 64x128 w4 st4 p0', TRITON),
}


def _parsed_table(table: dict, name: str = "GEMV_TABLE") -> dict[int, tuple[tuple[float, GemvConfig, bool], ...]]:
    """Configs parsed and the rule checked once: sizes ascend, the last entry takes any size."""
    out = {}
    for rows, entries in sorted(table.items()):
        limits = [math.inf if mib is None else mib * 2**20 for mib, _, _ in entries]
        if not entries or limits[-1] != math.inf or limits != sorted(set(limits)):
            raise ValueError(f"{name}[{rows}]: sizes must ascend and end with None (any size)")
        if any(winner not in (TRITON, CUBLAS) for *_, winner in entries):
            raise ValueError(f"{name}[{rows}]: winners are {TRITON!r} or {CUBLAS!r}")
        out[rows] = tuple((limit, GemvConfig.parse(cfg), winner == TRITON)
                          for limit, (_, cfg, winner) in zip(limits, entries))
    return out


_TABLE = _parsed_table(GEMV_TABLE)
_FP8_TABLE = _parsed_table(FP8_GEMV_TABLE, "FP8_GEMV_TABLE")


def _parsed_shapes(shapes: dict) -> dict[tuple[int, int, int], tuple[GemvConfig, bool]]:
    """GEMV_SHAPES parsed and checked once: each key's rows are a GEMV_TABLE bucket."""
    out = {}
    for (rows, n, k), (cfg, winner) in shapes.items():
        if rows not in GEMV_TABLE or winner not in (TRITON, CUBLAS):
            raise ValueError(f"GEMV_SHAPES[{rows, n, k}]: rows must be a GEMV_TABLE bucket and the winner "
                             f"{TRITON!r} or {CUBLAS!r}")
        out[rows, n, k] = GemvConfig.parse(cfg), winner == TRITON
    return out


_SHAPES = _parsed_shapes(GEMV_SHAPES)


def _bucket(m: int, keys) -> int:
    fits = [b for b in keys if b >= m]
    if not fits:
        raise ValueError(f"the gemv kernel handles 1..{MAX_M} rows, got {m}")
    return min(fits)


def choose(m: int, n: int, k: int, element_size: int) -> tuple[GemvConfig, bool]:
    """(the Triton variant for a product of m rows with an [n, k] weight, whether it beats cuBLAS there): GEMV_SHAPES'
    entry for the shape, else GEMV_TABLE's for its size; element_size 1 (fp8 weights) reads FP8_GEMV_TABLE."""
    weight_bytes = n * k * element_size
    table = _FP8_TABLE if element_size == 1 else _TABLE
    bucket = _bucket(m, table)
    if element_size != 1 and (bucket, n, k) in _SHAPES:  # a shape measured on its own
        return _SHAPES[bucket, n, k]
    for limit, cfg, triton_wins in table[bucket]:
        if weight_bytes <= limit:
            return cfg, triton_wins
    raise AssertionError("unreachable: the last entry takes any size")


@dataclass(frozen=True)
class LaunchPlan:
    """A config resolved for one (M, N, K): the exact launch."""

    block_m: int
    block_n: int
    block_k: int
    n_tiles: int  # cdiv(N, block_n)
    split_k: int
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int
    use_dot: bool
    reduce_chunk: int  # partials the last program loads at once
    act_fp8: bool = False

    @property
    def grid(self) -> tuple[int, int]:
        return (self.n_tiles, self.split_k)


def plan(config: GemvConfig, m: int, n: int, k: int, sms: int, element_size: int = 2,
         x_element_size: int | None = None) -> LaunchPlan:
    """Resolve block sizes, the K split and the pipeline depth for one shape (pure; unit-tested). The depth is
    cut to what fits PIPELINE_SMEM_BYTES: each stage holds a weight tile of element_size bytes a value (and for
    tl.dot an x tile of x_element_size, by default the same)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the gemv kernel handles 1..{MAX_M} rows, got {m}")
    if not config.use_dot and m > FMA_MAX_ROWS:
        raise ValueError(f"the fma path handles 1..{FMA_MAX_ROWS} rows, got {m}: use a dot config")
    block_m = max(16, next_power_of_2(m)) if config.use_dot else next_power_of_2(m)
    floor_k = ACT_FP8_MIN_K if config.act_fp8 else 16 if config.use_dot else 1
    block_k = max(floor_k, min(config.block_k, next_power_of_2(k)))
    k_blocks = cdiv(k, block_k)
    tiles = cdiv(n, config.block_n)
    if config.split_k is not None:
        split = config.split_k
    elif config.programs_per_sm > 0:
        split = cdiv(math.ceil(config.programs_per_sm * sms), tiles)
    else:
        split = 1
    split = max(1, min(split, k_blocks, MAX_SPLIT_K))
    if tiles > COUNTER_SLOTS:
        split = 1
    k_per_split = cdiv(k_blocks, split) * block_k
    split = cdiv(k, k_per_split)  # no empty slices
    # The last program of a tile sums [reduce_chunk, block_n, block_m] partials per load round.
    reduce_chunk = max(1, min(8, prev_power_of_2(2048 // (config.block_n * block_m))))
    x_bytes = (1 if config.act_fp8 else x_element_size or element_size) * block_m if config.use_dot else 0
    stage_bytes = (config.block_n * element_size + x_bytes) * block_k
    stages = max(1, min(config.num_stages, PIPELINE_SMEM_BYTES // stage_bytes))
    return LaunchPlan(block_m=block_m, block_n=config.block_n, block_k=block_k, n_tiles=tiles, split_k=split,
                      k_per_split=k_per_split, num_warps=config.num_warps, num_stages=stages,
                      use_dot=config.use_dot, reduce_chunk=reduce_chunk, act_fp8=config.act_fp8)


# -- persistent split-K counters -------------------------------------------------------------------
_counters: dict[torch.device, torch.Tensor] = {}


def _counters_for(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counter buffer; None while a CUDA graph is being captured and the buffer
    does not exist yet (it must not come from the graph's private pool, which dies with the graph)."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


# -- entry points ------------------------------------------------------------------------------------
# Every entry point takes weight_scale: None for a weight in the activation dtype, or the fp32 per-channel
# scales [N] of a float8_e4m3fn weight (kernels/fp8.py). Many rows then go to fp8.linear instead of F.linear.
def _weight_ok(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """The weight is x's dtype without a scale, or fp8 with fp32 scales (per output row or per 128x128 block) on
    x's device."""
    if weight_scale is None:
        return weight.dtype == x.dtype
    return (weight.dtype == fp8.FP8_DTYPE and weight_scale.dtype == torch.float32
            and fp8.scale_shape_ok(weight, weight_scale) and weight_scale.is_contiguous()
            and weight_scale.device == weight.device)


def kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   weight_scale: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernel can take these arguments at all (where it is worth it is choose()'s call)."""
    if not use_triton(x) or x.dim() != 2 or weight.dim() != 2:
        return False
    m, k = x.shape
    n = weight.shape[0]
    if not (1 <= m <= MAX_M) or x.dtype not in KERNEL_DTYPES or not _weight_ok(x, weight, weight_scale):
        return False
    if weight.shape[1] != k or k % 16 or not weight.is_contiguous() or weight.device != x.device:
        return False
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return False  # the kernel has no backward
    return True


def _fuses(switch: bool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           weight_scale: torch.Tensor | None = None) -> bool:
    return switch and x.shape[0] <= SWITCHES.fuse_max_m and x.stride(-1) == 1 and kernel_applies(x, weight, bias, weight_scale)


def _library_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_scale: torch.Tensor | None) -> torch.Tensor:
    """The product without the kernel: cuBLAS (or the CPU's matmul), through kernels/fp8.py for fp8 weights."""
    if weight_scale is None:
        return F.linear(x, weight, bias)
    return fp8.linear(x, weight, weight_scale, bias)


def _variant(x, weight, bias, weight_scale, config: GemvConfig | None) -> GemvConfig | None:
    """The Triton variant that runs x @ weight.T (config, else the table's), or None where the library path does; the
    tests' force_triton switch takes the kernel whatever kernel_applies and the table say. The table's cuBLAS entries
    for fp8 weights are _scaled_mm's; where it does not apply (128x128-block scales) the library path would dequantize
    the weight every call (measured: notes/PERF.md, issue 34 figures, gemv._variant)."""
    forced = SWITCHES.force_triton
    if forced or kernel_applies(x, weight, bias, weight_scale):
        cfg, triton_wins = choose(x.shape[0], weight.shape[0], x.shape[1], weight.element_size())
        if forced or triton_wins or (weight_scale is not None
                                     and not fp8.scaled_mm_applies(x, weight, weight_scale, bias)):
            return config or cfg
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           weight_scale: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) (weight · weight_scale for fp8); the Triton kernel where GEMV_TABLE says it wins
    (or under the force_triton switch, on any device — CPU runs go through TRITON_INTERPRET=1). config overrides the
    table. A dot8q variant first quantizes x in a kernel of its own (fp8.quantize_activations)."""
    cfg = _variant(x, weight, bias, weight_scale, config)
    if cfg is None:
        return _library_linear(x, weight, bias, weight_scale)
    rows = fp8.quantize_activations(x) if cfg.act_fp8 else x
    return _launch(rows, weight, bias, x.shape[1], cfg, weight_scale=weight_scale)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    weight_scale: torch.Tensor | None = None, config: GemvConfig | None = None,
                    activation: str = "silu") -> torch.Tensor:
    """(act(gate) * up) @ weight.T + bias for gate_up [M, 2I] (the MLP's down projection; act: a fused.ACTIVATIONS
    name): a dot8q variant gets its input quantized by the act-mul kernel itself."""
    fused.activation_id(activation)  # an unknown activation fails before any launch
    x = gate_up[:, :gate_up.shape[1] // 2]  # the shape, dtype and device of the product's input
    cfg = _variant(x, weight, bias, weight_scale, config)
    if cfg is not None and cfg.act_fp8:
        return _launch(fused.silu_and_mul(gate_up, quantize=True, activation=activation), weight, bias, x.shape[1],
                       cfg, weight_scale=weight_scale)
    return linear(fused.silu_and_mul(gate_up, activation=activation), weight, bias, weight_scale=weight_scale,
                  config=config)


def _norm_in_prologue(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                      weight_scale: torch.Tensor | None) -> bool:
    """Whether norm_linear runs its norm in the GEMV's prologue: under SWITCHES.fuse_norm for up to fuse_max_m rows of
    fuse_norm_min_k…fuse_norm_max_k values (always under force_triton)."""
    return SWITCHES.force_triton or (_fuses(SWITCHES.fuse_norm, x, weight, bias, weight_scale)
                                     and SWITCHES.fuse_norm_min_k <= x.shape[1] <= SWITCHES.fuse_norm_max_k
                                     and (residual is None or residual.stride(-1) == 1))


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor | None = None,
                config: GemvConfig | None = None, x_norm: tuple[torch.Tensor, float] | None = None):
    """(rms_norm(x + residual) · norm_weight) @ weight.T + bias, and the new residual x + residual.

    Where _norm_in_prologue says so the norm runs inside the GEMV's prologue.
    Without a residual (the first layer) the new residual is x itself. A dot8q variant gets the normed rows quantized
    by the norm kernel itself. x_norm = (weight, eps): a norm still owed to x (Gemma's post-norm), applied before the
    add by the norm kernel (fused.rms_norm's x_norm), or by a launch of its own where the prologue (which does one
    norm) runs the norm or there is no residual (the new residual is then the post-normed x)."""
    cfg = _variant(x, weight, bias, weight_scale, config)
    quantized = cfg is not None and cfg.act_fp8
    in_prologue = not quantized and _norm_in_prologue(x, residual, weight, bias, weight_scale)
    if x_norm is not None and (in_prologue or residual is None):
        x, x_norm = fused.rms_norm(x, *x_norm), None
    if quantized:
        out = fused.rms_norm(x, norm_weight, eps, residual, quantize=True, x_norm=x_norm)
        rows, new_residual = out if residual is not None else (out, x)
        return _launch(rows, weight, bias, x.shape[1], cfg, weight_scale=weight_scale), new_residual
    if not in_prologue:
        if residual is None:
            return linear(fused.rms_norm(x, norm_weight, eps), weight, bias, weight_scale=weight_scale), x
        normed, residual = fused.rms_norm(x, norm_weight, eps, residual, x_norm=x_norm)
        return linear(normed, weight, bias, weight_scale=weight_scale), residual
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    cfg = config or choose(x.shape[0], weight.shape[0], x.shape[1], weight.element_size())[0]
    out = _launch(x, weight, bias, x.shape[1], cfg, _NORM, norm=(residual, new_residual, norm_weight, eps),
                  weight_scale=weight_scale)
    return out, new_residual


def norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None, rope: QKVRope, *,
                  weight_scale: torch.Tensor | None = None, x_norm: tuple[torch.Tensor, float] | None = None):
    """The attention input of a decoder layer: (q, k, v, new residual) after rms_norm(x + residual) → qkv
    projection (norm_linear; x_norm: its owed post-norm) → q/k RMSNorm (Qwen3) + RoPE (over the table's rotary_dim:
    partial rotary where it is narrower than a head) with k and v stored in the paged cache (one kernel,
    rotary_kv.qk_norm_rope). A qkv-epilogue variant (one head per output tile) was removed: it left the qkv GEMV
    N / head_dim programs and no split-K, and the H200 measured it slower (notes/PERF.md, issue 34 figures,
    gemv.norm_qkv_rope)."""
    qkv, residual = norm_linear(x, residual, norm_weight, eps, weight, bias, weight_scale=weight_scale, x_norm=x_norm)
    q, k, v = rope.split(qkv)
    q, k = rope.apply(q, k, v)
    return q, k, v, residual


_PLAIN, _NORM = 0, 1  # prologue: what the kernel does to x as it loads it


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.dtype:
    """The dtype the product is written in (and x is rounded to for tl.dot): the weight's, or for fp8 weights the
    activations'."""
    if weight_scale is None:
        return weight.dtype
    if weight.dtype != fp8.FP8_DTYPE or not fp8.scale_shape_ok(weight, weight_scale) \
            or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale goes with a {fp8.FP8_DTYPE} weight as fp32 [N] per-channel or "
                         f"[cdiv(N, {fp8.BLOCK}), cdiv(K, {fp8.BLOCK})] per-block scales; got a {weight.dtype} weight "
                         f"{tuple(weight.shape)} and {weight_scale.dtype} scales {tuple(weight_scale.shape)}")
    return x.dtype


def _launch(x, weight, bias, k, config, prologue=_PLAIN, norm=None,
            weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One kernel launch. norm = (residual | None, residual_out, norm_weight, eps) for the RMSNorm prologue; x is
    fp8.Fp8Rows for a dot8q variant."""
    if isinstance(x, fp8.Fp8Rows) != config.act_fp8:
        raise ValueError(f"{config.short()} takes {'fp8.Fp8Rows' if config.act_fp8 else 'a tensor'} as x")
    rows = x if config.act_fp8 else None
    x = rows.codes if rows is not None else x
    if not HAS_TRITON:
        raise RuntimeError("the Triton GEMV was requested but triton is not installed")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype == fp8.FP8_DTYPE and weight_scale is None:
        raise ValueError("an fp8 weight needs its weight_scale")
    if config.act_fp8 and weight.dtype != fp8.FP8_DTYPE:
        raise ValueError(f"{config.short()} (W8A8) multiplies an fp8 weight, got a {weight.dtype} one")
    m, n = x.shape[0], weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    dtype = _output_dtype(x, weight, weight_scale)  # which also checks the weight and its scales
    if rows is not None:  # the codes' dtype is fp8; the product is written in the dtype they were quantized from
        dtype = rows.dtype
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    sizes = (weight.element_size(), dtype.itemsize)
    p = plan(config, m, n, k, num_sms(x.device), *sizes)
    counters = _counters_for(x.device) if p.split_k > 1 else None
    if p.split_k > 1 and counters is None:  # first use inside a capture: take the unsplit variant
        p = plan(dataclasses.replace(config, split_k=1), m, n, k, 1, *sizes)
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    if p.split_k > 1:
        partials = torch.empty(p.split_k, m, n, dtype=torch.float32, device=x.device)
    else:  # never touched; placeholders of the same dtypes let both kinds of launch share one compiled kernel
        partials = torch.empty(1, dtype=torch.float32, device=x.device)
        counters = torch.empty(1, dtype=torch.int32, device=x.device)
    residual, residual_out, norm_weight, eps = norm if norm is not None else (None, x, x, 0.0)
    block_scaled = weight_scale is not None and weight_scale.dim() == 2
    _gemv_kernel[p.grid](
        x, weight, weight_scale if weight_scale is not None else partials, bias if bias is not None else out, out,
        partials, counters,
        residual if residual is not None else x, residual_out, norm_weight, eps,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, residual_out.stride(0),
        out.stride(0), p.k_per_split, weight_scale.shape[1] if block_scaled else 0,
        rows.scales if rows is not None else partials, rows.scales.stride(0) if rows is not None else 0,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        NORM_K=max(1, min(p.block_k, prev_power_of_2(NORM_CHUNK // p.block_m))), USE_DOT=p.use_dot,
        EVEN_K=k % p.block_k == 0, HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None and not block_scaled,
        SCALE_BLOCK=fp8.BLOCK if block_scaled else 0, SCALE_NB=max(1, p.block_k // fp8.BLOCK),
        ACT_FP8=p.act_fp8, REDUCE_CHUNK=p.reduce_chunk,
        LOOP_STAGES=p.num_stages, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        DOT_IN_FP32=not x.is_cuda,  # the interpreter (CPU tensors) multiplies bf16 bit patterns as integers
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        PREFETCH_LINES=_prefetch_lines(p, weight.numel() * sizes[0], sizes[0], x.device), PREFETCH_STEP=128 // sizes[0],
        num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args(x.device))
    return out


PREFETCH_MAX_LINES = 4096  # 512 KiB a program: more than any variant's slice of the decode matrices
# Matrices up to this size are prefetched (L2 holds 50 MB; Llama-3.1-8B's 32-224 MB matrices, whose resident programs
# alone ask for more than it holds, ran slower with the prefetch: notes/PERF.md, issue 34 figures,
# gemv.PREFETCH_MAX_WEIGHT_BYTES).
PREFETCH_MAX_WEIGHT_BYTES = 16 * 2**20


def _prefetch_lines(p: LaunchPlan, weight_bytes: int, element_size: int, device: torch.device) -> int:
    """Lines each program prefetches into L2 before the PDL wait (a power of two; 0: none): its whole slice of W,
    when SWITCHES.gemv_prefetch is on, PDL runs, the matrix is small, there are several rows (at one row it cost a
    little: notes/PERF.md, issue 34 figures, gemv._prefetch_lines) and the slice is more than the one tile
    loaded before the wait."""
    if not (SWITCHES.gemv_prefetch and pdl_enabled(device)) or p.k_per_split <= p.block_k or p.block_m == 1 \
            or weight_bytes > PREFETCH_MAX_WEIGHT_BYTES:
        return 0
    lines = next_power_of_2(p.block_n * cdiv(p.k_per_split * element_size, 128))
    return lines if lines <= PREFETCH_MAX_LINES else 0


@jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs: no registers, no wait (the loads after gdc_wait then hit L2)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def _prefetch_weights(w_ptr, pid_n, N, K, k_start, k_stop, BLOCK_N: tl.constexpr, LINES: tl.constexpr,
                      LINE: tl.constexpr):
    """Prefetch rows [pid_n * BLOCK_N, +BLOCK_N) x columns [k_start, k_stop) of W, one line (LINE elements) each."""
    idx = tl.arange(0, LINES)
    per_row = tl.cdiv(k_stop - k_start, LINE)
    row = tl.minimum(idx // per_row, BLOCK_N - 1)
    col = tl.minimum(k_start + (idx % per_row) * LINE, K - 1)
    _prefetch_l2(w_ptr + ((pid_n * BLOCK_N + row) % N).to(tl.int64) * K + col)


@jit
def _load_weight(w_rows, cols, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + cols)
    return tl.load(w_rows + cols, mask=cols < K, other=0.0)


@jit
def _inv_rms(x_ptr, res_ptr, offs_m, M, K, stride_xm, stride_rm, eps,
             BLOCK_M: tl.constexpr, NORM_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """1 / rms of rows x + residual over all of K (the sum rounded to the model dtype, like HF's add): [BLOCK_M]."""
    rows = offs_m[:, None]
    cols = tl.arange(0, NORM_K)[None, :]
    sum_sq = tl.zeros((BLOCK_M, NORM_K), dtype=tl.float32)
    for k in range(0, K, NORM_K):
        mask = (rows < M) & (k + cols < K)
        h = tl.load(x_ptr + rows * stride_xm + k + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows * stride_rm + k + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        h = h.to(tl.float32)
        sum_sq += h * h
    return tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)


@jit
def _x_values(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, row_ok, cols, K, stride_xm, stride_rm, stride_rom,
              inv_rms, write_residual, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The x the product sees at (rows, cols), as fp32 holding model-dtype values: x itself, or
    norm_w · round(h · inv_rms) with h = x + residual (written to res_out where write_residual), rounded like
    the separate kernel it replaces."""
    mask = row_ok & (cols < K)
    x = tl.load(x_ptr + rows * stride_xm + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows * stride_rm + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if write_residual:
                tl.store(res_out_ptr + rows * stride_rom + cols, x, mask=mask)
        nw = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        return (nw * (x.to(tl.float32) * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x.to(tl.float32)


@jit
def _dot_fp8_rows(acc, w, x_ptr, xs_ptr, offs_m, cols, k, M, K, stride_xm, stride_xs, w_scale,
                  DOT_IN_FP32: tl.constexpr):
    """W8A8 on pre-quantized rows (fp8.Fp8Rows): acc += (w · w_scale) @ (codes · scales).T, the codes [BLOCK_M, cols]
    loaded as they are (half the bytes of bf16, nothing to compute) and multiplied on the FP8 tensor cores."""
    xq = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols, mask=(offs_m[:, None] < M) & (cols < K), other=0.0)
    x_scale = tl.load(xs_ptr + offs_m * stride_xs + k // SCALE_GROUP_K, mask=offs_m < M, other=0.0)
    if DOT_IN_FP32:
        product = tl.dot(w.to(tl.float32), tl.trans(xq.to(tl.float32)), input_precision="ieee")
    else:
        product = tl.dot(w, tl.trans(xq))
    return acc + product * x_scale[None, :] * w_scale


@jit
def _accumulate(acc, acc_wide, w, k, offs_m, offs_k, M, K, x_ptr, out_ptr, res_ptr, res_out_ptr, norm_w_ptr,
                stride_xm, stride_rm, stride_rom, inv_rms, write_residual, w_scale, xs_ptr, stride_xs,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                DOT_IN_FP32: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                ACT_FP8: tl.constexpr):
    """Fold the weight tile w [BLOCK_N, BLOCK_K] at column k into the accumulators. An fp8 tile is converted to the
    activation dtype (out's; exact: e4m3 values are bf16 / fp16 values) and multiplied like a bf16 one, or with
    ACT_FP8 multiplied as it is by x's fp8 codes (w_scale: _tile_scale's)."""
    cols = k + offs_k[None, :]
    dtype = out_ptr.dtype.element_ty
    if ACT_FP8:  # x is fp8 codes, with a scale per row and 128 columns
        acc = _dot_fp8_rows(acc, w, x_ptr, xs_ptr, offs_m, cols, k, M, K, stride_xm, stride_xs, w_scale, DOT_IN_FP32)
    elif USE_DOT:
        x = _x_values(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, offs_m[:, None], offs_m[:, None] < M, cols, K,
                      stride_xm, stride_rm, stride_rom, inv_rms[:, None], write_residual, PROLOGUE, HAS_RESIDUAL)
        if DOT_IN_FP32:  # same products: bf16 x bf16 is exact in fp32
            acc = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(dtype), tl.trans(x.to(dtype)), acc, input_precision=DOT_PRECISION)
    elif BLOCK_M == 1:
        x = _x_values(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, offs_m[:, None], offs_m[:, None] < M, cols, K,
                      stride_xm, stride_rm, stride_rom, inv_rms[:, None], write_residual, PROLOGUE, HAS_RESIDUAL)
        acc_wide += w.to(tl.float32) * x
    else:  # one row of x at a time keeps the live registers at one [BLOCK_N, BLOCK_K] product
        wf = w.to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            row = tl.full((1, 1), i, dtype=tl.int32)
            inv_i = tl.sum(tl.where(offs_m == i, inv_rms, 0.0), axis=0)
            xi = _x_values(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, row, row < M, cols, K, stride_xm, stride_rm,
                           stride_rom, inv_i, write_residual, PROLOGUE, HAS_RESIDUAL)
            product = tl.sum(wf * xi, axis=1)
            acc += tl.where(offs_m[None, :] == i, product[:, None], 0.0)
    return acc, acc_wide


@jit
def _block_scaled(w, scale_ptr, rows, k, scale_cols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALE_BLOCK: tl.constexpr, SCALE_NB: tl.constexpr):
    """A weight tile [BLOCK_N, BLOCK_K] at column k (rows: its row indices) times its blocks' fp32 scales, in fp32.
    The tile spans SCALE_NB scale blocks along K (1 when it lies inside one): only [BLOCK_N, SCALE_NB] scales are
    loaded (a gather per weight would pipeline 4 bytes of scale beside each fp8 byte through shared memory)."""
    kb = k // SCALE_BLOCK + tl.arange(0, SCALE_NB)
    s = tl.load(scale_ptr + (rows // SCALE_BLOCK)[:, None] * scale_cols + kb[None, :],
                mask=(kb < scale_cols)[None, :], other=0.0)
    w3 = tl.reshape(w.to(tl.float32), (BLOCK_N, SCALE_NB, BLOCK_K // SCALE_NB))
    return tl.reshape(w3 * s[:, :, None], (BLOCK_N, BLOCK_K))


@jit
def _tile_scale(scale_ptr, rows, k, scale_cols, SCALE_BLOCK: tl.constexpr):
    """The W8A8 path's weight scale for a tile at column k: its rows' block scales [BLOCK_N, 1] (the tile lies in one
    block along K), or 1.0 where the channel scales are applied at the store."""
    scale = 1.0
    if SCALE_BLOCK > 0:  # one return: the compiler refuses returns of two types, even under a constexpr branch
        scale = tl.load(scale_ptr + (rows // SCALE_BLOCK) * scale_cols + k // SCALE_BLOCK)[:, None]
    return scale


@jit
def _store_tile(acc, scale_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om,
                HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] fp32 (· the fp8 channel scales, + bias, in fp32) → out[m, n] rounded once."""
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit(do_not_specialize=["M"])  # one compiled kernel for every batch
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                 res_ptr, res_out_ptr, norm_w_ptr, eps,
                 M, N, K, stride_xm, stride_rm, stride_rom, stride_om, k_per_split, scale_cols, xs_ptr, stride_xs,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
                 USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                 REDUCE_CHUNK: tl.constexpr, LOOP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 PREFETCH_LINES: tl.constexpr, PREFETCH_STEP: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                 SCALE_NB: tl.constexpr, ACT_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N wrap around so weight loads need no mask (those outputs are never stored).
    w_rows = w_ptr + (offs_n % N).to(tl.int64)[:, None] * K
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    k_loop = k_start
    pdl_start(USE_PDL)
    if USE_PDL:  # the first weight tile streams in while the previous kernel finishes; x only after the wait
        if PREFETCH_LINES > 0:  # and L2 fetches the rest of this program's weights meanwhile
            _prefetch_weights(w_ptr, pid_n, N, K, k_start, k_stop, BLOCK_N, PREFETCH_LINES, PREFETCH_STEP)
        w_first = _load_weight(w_rows, k_start + offs_k[None, :], K, EVEN_K)
        if SCALE_BLOCK > 0 and not ACT_FP8:
            w_first = _block_scaled(w_first, scale_ptr, offs_n % N, k_start, scale_cols, BLOCK_N, BLOCK_K,
                                    SCALE_BLOCK, SCALE_NB)
        pdl_wait(USE_PDL)
        k_loop = k_start + BLOCK_K

    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        inv_rms = _inv_rms(x_ptr, res_ptr, offs_m, M, K, stride_xm, stride_rm, eps, BLOCK_M, NORM_K, HAS_RESIDUAL)
    write_residual = pid_n == 0  # the programs of the first column tile write the new residual stream

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # M = 1: reduce over K once, at the end
    if USE_PDL:
        acc, acc_wide = _accumulate(acc, acc_wide, w_first, k_start, offs_m, offs_k, M, K, x_ptr, out_ptr, res_ptr,
                                    res_out_ptr, norm_w_ptr, stride_xm, stride_rm, stride_rom, inv_rms,
                                    write_residual, _tile_scale(scale_ptr, offs_n % N, k_start, scale_cols,
                                                                SCALE_BLOCK if ACT_FP8 else 0),
                                    xs_ptr, stride_xs, BLOCK_M, BLOCK_K, USE_DOT, DOT_PRECISION, DOT_IN_FP32,
                                    PROLOGUE, HAS_RESIDUAL, ACT_FP8)
    for k in tl.range(k_loop, k_stop, BLOCK_K, num_stages=LOOP_STAGES):
        w = _load_weight(w_rows, k + offs_k[None, :], K, EVEN_K)
        if SCALE_BLOCK > 0 and not ACT_FP8:
            w = _block_scaled(w, scale_ptr, offs_n % N, k, scale_cols, BLOCK_N, BLOCK_K, SCALE_BLOCK, SCALE_NB)
        acc, acc_wide = _accumulate(acc, acc_wide, w, k, offs_m, offs_k, M, K, x_ptr, out_ptr, res_ptr, res_out_ptr,
                                    norm_w_ptr, stride_xm, stride_rm, stride_rom, inv_rms, write_residual,
                                    _tile_scale(scale_ptr, offs_n % N, k, scale_cols, SCALE_BLOCK if ACT_FP8 else 0),
                                    xs_ptr, stride_xs, BLOCK_M, BLOCK_K, USE_DOT, DOT_PRECISION, DOT_IN_FP32,
                                    PROLOGUE, HAS_RESIDUAL, ACT_FP8)
    if not USE_DOT and BLOCK_M == 1:
        acc = tl.sum(acc_wide, axis=1)[:, None]

    if num_splits == 1:
        _store_tile(acc, scale_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_SCALE, HAS_BIAS)
    else:
        out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        tile = offs_m[None, :] * N + offs_n[:, None]  # partials are [split, M, N] fp32
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # all threads' partials are written before the (thread-0) release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # last program of this tile: reduce in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            offs_s = tl.arange(0, REDUCE_CHUNK)
            for s0 in range(0, num_splits, REDUCE_CHUNK):
                s = s0 + offs_s
                parts = tl.load(partial_ptr + s[:, None, None] * (M * N) + tile[None, :, :],
                                mask=(s < num_splits)[:, None, None] & out_mask[None, :, :], other=0.0,
                                cache_modifier=".cg")  # from L2: other SMs wrote them
                total += tl.sum(parts, axis=0)
            _store_tile(total, scale_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_SCALE, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call / graph replay
