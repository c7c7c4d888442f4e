"""The KV store's cost per cache format (issue 37): the fused q/k-norm + RoPE + KV-store kernel of one decode step,
Qwen3-0.6B's heads (16 q, 8 kv, head_dim 128, q/k norms), µs a layer.

    python benchmarks/kv_store.py [--batch-sizes 256 1] [--out FILE]

Each case: a graph of 8 layers, each layer's store followed by a 256 MB copy that evicts L2 as the decode attention
does in the engine (a store's partly written 32-byte sectors are written back there); the store kernel's time from
the profiler (the best of 5 replays). Formats: bf16 (16-token blocks), fp8 as the engine lays it out (32-token blocks,
V transposed within each block, the scale pairs, the bf16 tail), fp8 with V token-major (what the transposition
costs), fp8 without the tail; the kernel's warps (the engine launches 1 up to rotary_kv.ROPE_ONE_WARP_TOKENS tokens,
else 4) and the token's offset in its block.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Relaunched, env_info, write_json  # noqa: E402
from nanoserve.bench.profile import profile_step  # noqa: E402
from nanoserve.kernels import kv_quant, rotary_kv  # noqa: E402
from nanoserve.runner.kv_cache import fp8_layout  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, TOKENS_PER_SEQ = 16, 8, 128, 8, 1024
# (cache format, tail, warps, the token's offset: 511 is a block's last token, 500 not)
CASES = [("bf16", False, 4, 511), ("fp8", True, 4, 511), ("fp8", True, 4, 500), ("fp8-token-major-v", True, 4, 511),
         ("fp8", False, 4, 511), ("fp8", True, 2, 511), ("fp8", True, 1, 511), ("bf16", False, 2, 511),
         ("bf16", False, 1, 511)]


def caches(b: int, fmt: str) -> list[tuple]:
    """LAYERS (k, v, scales) caches of b sequences' blocks in `fmt`."""
    block = 16 if fmt == "bf16" else 32
    blocks = b * (TOKENS_PER_SEQ // block) + 1
    dtype = torch.bfloat16 if fmt == "bf16" else kv_quant.FP8_DTYPE
    out = []
    for _ in range(LAYERS):
        k = torch.zeros(blocks, block, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
        v, scales = torch.zeros_like(k), None
        if fmt != "bf16":
            scales = tuple(torch.zeros(blocks, block, KV_HEADS, dtype=kv_quant.TOKEN_SCALE_DTYPE, device="cuda")
                           for _ in range(2))
            if fmt == "fp8":
                v, scales = fp8_layout(v, scales)
        out.append((k, v, scales))
    return out


def store_us(b: int, fmt: str, tail: bool, warps: int, offset: int) -> float:
    """µs a layer of the store kernel for b tokens (sequence i at `offset` of its blocks) in one case."""
    layers = caches(b, fmt)
    block = layers[0][0].shape[1]
    seqs = torch.arange(b, device="cuda")
    pos = torch.full((b,), offset, device="cuda")
    slots = ((seqs * (TOKENS_PER_SEQ // block) + pos // block) * block + pos % block).int()
    kv_tail = tuple(torch.zeros(b * kv_quant.TAIL_BANKS * block, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                                device="cuda") for _ in range(2)) if tail else None
    tail_rows = kv_quant.tail_row(seqs, pos, block).int() if tail else None
    qkv = torch.randn(b, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.view(b, -1, HEAD_DIM) for x in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                            KV_HEADS * HEAD_DIM], dim=-1))
    cos_sin = torch.randn(4096, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    norms = [torch.rand(HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    evict = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    kernel, positions = rotary_kv._qk_norm_rope_kernel, pos.int()

    def run():
        for k_cache, v_cache, scales in layers:
            rotary_kv.qk_norm_rope(q, k, cos_sin, positions, *norms, 1e-6,
                                   kv_store=(v, k_cache, v_cache, slots, scales, kv_tail, tail_rows))
            evict[1].copy_(evict[0])

    rotary_kv._qk_norm_rope_kernel = Relaunched(kernel, num_warps=warps)
    try:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(5):
            stores = [end - start for name, start, end in profile_step(graph.replay) if "rope" in name]
            times.append(sum(stores) / len(stores))
        return min(times)
    finally:
        rotary_kv._qk_norm_rope_kernel = kernel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[256, 1])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kv_store.py needs a CUDA GPU")
        return 0
    rows = []
    for b in args.batch_sizes:
        for fmt, tail, warps, offset in CASES:
            try:
                us = store_us(b, fmt, tail, warps, offset)
            except Exception as exc:  # noqa: BLE001 (recorded; the other cases still run)
                us = f"{type(exc).__name__}: {exc}"[:200]
            rows.append({"b": b, "format": fmt, "tail": tail, "warps": warps, "offset": offset, "us_per_layer": us})
            print(rows[-1], flush=True)
    if args.out:
        write_json(args.out, {"env": env_info(), "cases": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
