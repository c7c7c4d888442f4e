"""The decode attention kernel's PTX instruction mix per cache format, compiled for sm_90 on any machine (no GPU).

Why fp8 K/V tiles cost as much time as bf16 ones though they are half the bytes (notes/PERF.md, round 8, third
session): the mix shows how each format's tiles reach the tensor-core products. Counts are static PTX instructions of
the whole kernel (the key-tile loop dominates), at Qwen3-0.6B's head shape (16 q / 8 kv heads, head_dim 128), one split.
Then the same count for the decode loop's two products alone (q @ k^T, p @ v over 8 tiles of 64 keys) with each
operand stored dim-major (as the cache is) or token-major, widened to bf16 or fp16: which layout lets an 8-bit tile
reach the tensor cores through ldmatrix rather than scalar shared-memory loads.

    python benchmarks/decode_ptx.py [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_info, write_json  # noqa: E402

PTX_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
             torch.float8_e4m3fn: "fp8e4nv"}
CASES = [("bf16, 3 stages", torch.bfloat16, 3), ("bf16, 1 stage", torch.bfloat16, 1),
         ("fp8 token scales, 1 stage", torch.float8_e4m3fn, 1)]


def ptx_of_next_launch(captured: dict):
    """Patch Triton so that a launch compiles its kernel for sm_90 (PTX kept in `captured`) instead of running."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    def compile_instead(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        signature, constexprs, attrs = {}, {}, {}
        for i, param in enumerate(self.params):
            value = args[i] if i < len(args) else kwargs[param.name]
            if param.is_constexpr:  # the GPU's dot arguments, not the CPU tensors' interpreter ones
                gpu = {"DOT_UPCAST": False, "DOT_PRECISION": "tf32"}
                signature[param.name], constexprs[param.name] = "constexpr", gpu.get(param.name, value)
                continue
            if isinstance(value, int) and value == 1 and not param.do_not_specialize:
                signature[param.name], constexprs[param.name] = "constexpr", 1  # as a real launch specializes it
                continue
            if isinstance(value, torch.Tensor):
                signature[param.name], aligned = "*" + PTX_TYPES[value.dtype], True
            elif isinstance(value, float):
                signature[param.name], aligned = "fp32", False
            else:
                signature[param.name] = "i32"
                aligned = value % 16 == 0 and not param.do_not_specialize
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        captured[self.__name__] = compile(ASTSource(self, signature, constexprs, attrs),
                                          target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    JITFunction.run = compile_instead


def instruction_mix(ptx: str) -> dict:
    """Counts of the instruction kinds that tell how K/V tiles travel: global / shared loads and stores, ldmatrix,
    tensor-core products, conversions between 8- and 16-bit floats."""
    counts = collections.Counter()
    for line in ptx.splitlines():
        words = line.strip().rstrip(";").split()
        if not words or words[0].startswith(("//", ".", "$", "{", "}")):
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        base = op.split(".")[0]
        space = "shared" if ".shared" in op else "global" if ".global" in op else "other"
        kind = f"{base}.{space}" if base in ("ld", "st") else base
        if base == "cvt" and any(t in op for t in ("e4m3", "f16", "bf16")):
            kind = "cvt (fp8 / f16 / bf16)"
        counts[kind] += 1
    keys = ("ld.global", "cp", "st.shared", "ld.shared", "ldmatrix", "mma", "cvt (fp8 / f16 / bf16)")
    return {"total": sum(counts.values()), **{k: counts[k] for k in keys}}


def _product_kernels():
    """Toy decode loops: q @ k^T and p @ v over 8 key tiles, the K or V tile stored [keys, dims] or [dims, keys]."""
    import triton
    import triton.language as tl

    @triton.jit
    def qk(q_ptr, k_ptr, o_ptr, TOKEN_MAJOR: tl.constexpr, WIDEN: tl.constexpr):
        g, d, n = tl.arange(0, 16), tl.arange(0, 128), tl.arange(0, 64)
        q = tl.load(q_ptr + g[:, None] * 128 + d[None, :])
        acc = tl.zeros([16, 64], tl.float32)
        for i in range(8):
            if TOKEN_MAJOR:
                k_t = tl.load(k_ptr + i * 8192 + d[:, None] * 64 + n[None, :])
            else:
                k_t = tl.trans(tl.load(k_ptr + i * 8192 + n[:, None] * 128 + d[None, :]))
            if WIDEN:
                k_t = k_t.to(q.dtype)
            acc += tl.dot(q, k_t)
        tl.store(o_ptr + g[:, None] * 64 + n[None, :], acc)

    @triton.jit
    def pv(p_ptr, v_ptr, o_ptr, TOKEN_MAJOR: tl.constexpr, WIDEN: tl.constexpr):
        g, d, n = tl.arange(0, 16), tl.arange(0, 128), tl.arange(0, 64)
        p = tl.load(p_ptr + g[:, None] * 64 + n[None, :])
        acc = tl.zeros([16, 128], tl.float32)
        for i in range(8):
            if TOKEN_MAJOR:
                v = tl.trans(tl.load(v_ptr + i * 8192 + d[:, None] * 64 + n[None, :]))
            else:
                v = tl.load(v_ptr + i * 8192 + n[:, None] * 128 + d[None, :])
            if WIDEN:
                v = v.to(p.dtype)
            acc += tl.dot(p, v)
        tl.store(o_ptr + g[:, None] * 128 + d[None, :], acc)

    return {"q @ k^T": qk, "p @ v": pv}


def operand_layouts() -> dict:
    """The products' instruction mix per stored layout (dim-major / token-major) and cache / product dtypes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    rows = {}
    for name, kernel in _product_kernels().items():
        for layout, cache, act in [(lay, c, a) for lay in ("dim-major", "token-major")
                                   for c, a in (("bf16", "bf16"), ("fp8e4nv", "bf16"), ("fp8e4nv", "fp16"))]:
            names = [p.name for p in kernel.params]
            signature = {names[0]: "*" + act, names[1]: "*" + cache, names[2]: "*fp32",
                         "TOKEN_MAJOR": "constexpr", "WIDEN": "constexpr"}
            constexprs = {"TOKEN_MAJOR": layout == "token-major", "WIDEN": cache != act}
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
            ptx = compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 1}).asm["ptx"]
            label = f"{name}, {layout}, {cache} cache, {act} products"
            rows[label] = instruction_mix(ptx)
            print(f"{label:52s} " + ", ".join(f"{k} {v}" for k, v in rows[label].items()), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: this compiles for sm_90")
    from nanoserve.kernels import attention
    from nanoserve.kernels.switches import SWITCHES

    captured: dict = {}
    ptx_of_next_launch(captured)
    attention.num_sms = lambda device: 132
    SWITCHES.force_triton = True
    q = torch.randn(256, 16, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(256, 32, dtype=torch.int32), torch.full((256,), 512, dtype=torch.int32)
    rows = {}
    for name, dtype, stages in CASES:
        cache = torch.zeros(64, 16, 8, 128, dtype=dtype)
        scales = None if dtype == torch.bfloat16 else (torch.ones(64, 16, 8, dtype=torch.bfloat16),) * 2
        attention.DECODE_NUM_STAGES = attention.DECODE_NUM_STAGES_FP8 = stages
        attention.decode_attention(q, cache, cache, tables, lens, 0.1, kv_scales=scales, num_splits=1)
        rows[name] = instruction_mix(captured["_decode_kernel"])
        print(f"{name:28s} " + ", ".join(f"{k} {v}" for k, v in rows[name].items()), flush=True)
    products = operand_layouts()
    if args.out:
        write_json(args.out, {"env": env_info(), "kernel": "_decode_kernel", "shape": "16 q / 8 kv heads, d 128",
                              "ptx": rows, "products": products})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
