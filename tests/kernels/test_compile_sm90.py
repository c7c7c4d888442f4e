"""Every kernel variant of the decode path compiles for Hopper (sm_90), those that take PDL with it — checked without
a GPU.

The CPU interpreter runs the kernels as Python, so it cannot catch what only Triton's compiler rejects.
Here the host code runs on CPU tensors in a subprocess without TRITON_INTERPRET, and each launch is
compiled by triton.compile for a GPUTarget("cuda", 90) instead of being run (triton ships ptxas), with the
16-byte divisibility hints a real launch would give. The PTX must hold griddepcontrol.wait and
launch_dependents (kernels with a USE_PDL switch), and the GEMV's first weight loads must come before the wait (PDL's
point).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
RUN = os.environ.get("NANOSERVE_COMPILE_SM90") == "1"

SCRIPT = r'''
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

from nanoserve.kernels import attention, fp8, fused, gemv, moe, moe_gemm, ngram, rotary_kv
from nanoserve.kernels.gemv import GemvConfig
from nanoserve.kernels.switches import SWITCHES
from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.runner.kv_cache import fp8_layout

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def compile_instead(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(self.params):
        value = args[i] if i < len(args) else kwargs[param.name]
        if param.is_constexpr:
            # DOT_IN_FP32 is the interpreter's (CPU tensors here): the GPU's launch multiplies on tensor cores
            signature[param.name], constexprs[param.name] = "constexpr", False if param.name == "DOT_IN_FP32" else value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + DTYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[param.name], aligned = "fp32", False
        else:
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            aligned = value % 16 == 0 and not param.do_not_specialize
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    ptx = compile(ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                  options=options).asm["ptx"].splitlines()
    wait = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line]
    if "USE_PDL" in constexprs:
        assert wait and trigger and trigger[0] < wait[0], self.__name__  # the early trigger comes first
    if self.__name__ == "_gemv_kernel":
        assert any("ld.global" in line or "cp.async" in line for line in ptx[:wait[0]]), "no weight load before wait"
        if any("prefetch.global.L2" in line for line in ptx[:wait[0]]):
            print("prefetched", flush=True)
        if any("wgmma.mma_async" in line and "e4m3.e4m3" in line for line in ptx):
            print("fp8 tensor cores", flush=True)
    print("compiled", self.__name__, flush=True)


JITFunction.run = compile_instead
for module in (attention, fp8, fused, gemv, moe, moe_gemm, rotary_kv):
    module.pdl_args = lambda device: {"USE_PDL": True, "launch_pdl": True}
gemv.pdl_enabled = lambda device: True  # and the GEMVs prefetch their slices into L2 before the wait
SWITCHES.force_triton = True  # every entry point launches its kernel on these CPU tensors

attention.num_sms = lambda device: 132
bf = torch.bfloat16
x1, x3, x64 = (torch.randn(m, 1024, dtype=bf) for m in (1, 3, 64))
w, norm_w = torch.randn(4096, 1024, dtype=bf), torch.ones(1024, dtype=bf)
gemv.linear(x1, w, config=GemvConfig.parse("fma 4x1024 w4 st3 p0"))
gemv.linear(torch.randn(20, 1024, dtype=bf), w, torch.randn(4096, dtype=bf),
            config=GemvConfig.parse("dot 64x128 w4 st4 s3"))
gemv.norm_linear(x1, x1.clone(), norm_w, 1e-6, w, config=GemvConfig.parse("fma 8x512 w4 st3 s4"))
gemv.norm_linear(x64, x64.clone(), norm_w, 1e-6, w, config=GemvConfig.parse("dot 32x256 w4 st3 p1"))
gemv.linear(torch.randn(3, 3072, dtype=bf), torch.randn(1024, 3072, dtype=bf),
            config=GemvConfig.parse("fma 8x512 w4 st3 p0"))
kc, vc = torch.zeros(10, 16, 8, 128, dtype=bf), torch.zeros(10, 16, 8, 128, dtype=bf)
cos_sin = torch.randn(4096, 256, dtype=bf)
fused.rms_norm(x3, norm_w, 1e-6, x3.clone())
fused.silu_and_mul(torch.randn(3, 6144, dtype=bf))
fused.silu_and_mul(torch.randn(3, 6144, dtype=bf), activation="gelu_tanh")  # GeGLU (Gemma)
qkv = torch.randn(3, 4096, dtype=bf)
q, k, v = qkv[:, :2048].view(3, 16, 128), qkv[:, 2048:3072].view(3, 8, 128), qkv[:, 3072:].view(3, 8, 128)
slots = torch.zeros(3, dtype=torch.int64)
rotary_kv.qk_norm_rope(q, k, cos_sin, slots, torch.ones(128, dtype=bf), torch.ones(128, dtype=bf), 1e-6,
                       kv_store=(v, kc, vc, slots, None))
# partial rotary (Phi-4-mini: 96 of 128 dims)
rotary_kv.qk_norm_rope(q, k, torch.randn(4096, 192, dtype=bf), slots, kv_store=(v, kc, vc, slots, None))
attention.store_kv(k, v, kc, vc, slots)
tables, lens = torch.zeros(3, 32, dtype=torch.int32), torch.full((3,), 500, dtype=torch.int32)
attention.decode_attention(torch.randn(3, 16, 128, dtype=bf), kc, vc, tables, lens, 0.1)
# fp8 weights (W8A16): the table's variants and every fused path
q8, s8 = fp8.quantize(w)
for x in (x1, x3, x64):
    gemv.linear(x, q8, weight_scale=s8)
gemv.norm_linear(x3, x3.clone(), norm_w, 1e-6, q8, weight_scale=s8)
q8d, s8d = fp8.quantize(torch.randn(1024, 3072))
gemv.linear(torch.randn(3, 3072, dtype=bf), q8d, weight_scale=s8d)
q8b, s8b = fp8.quantize(w.float(), (128, 128))
gemv.linear(x1, q8b, weight_scale=s8b, config=GemvConfig.parse("dot8q 64x128 w4 st4 s2"))
# W8A8 on rows quantized before: by a kernel of its own, by the norm, by the SiLU-mul
dot8q = GemvConfig.parse("dot8q 128x128 w4 st4 p1")
gemv.linear(x3, q8, weight_scale=s8, config=dot8q)
gemv.norm_linear(x64, x64.clone(), norm_w, 1e-6, q8, weight_scale=s8, config=dot8q)
gemv.silu_mul_linear(torch.randn(3, 2048, dtype=bf), q8, weight_scale=s8, config=dot8q)
fp8.quantize_rows(torch.randn(5, 3000, dtype=bf))  # prefill's per-token quantize (_scaled_mm)
cu = torch.arange(4, dtype=torch.int32)
meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, context_lens=lens, block_tables=tables, cu_seqlens_q=cu,
                         max_seqlen_q=1, has_cached_prefix=True)
attention.paged_prefill_attention(torch.randn(3, 16, 128, dtype=bf), kc, vc, meta, 0.1)
# an fp8 KV cache: per-token scales and a per-layer scale, through every store and read
kc8, vc8 = torch.zeros(10, 16, 8, 128, dtype=torch.float8_e4m3fn), torch.zeros(10, 16, 8, 128, dtype=torch.float8_e4m3fn)
for scales in ((torch.ones(10, 16, 8, dtype=bf), torch.ones(10, 16, 8, dtype=bf)), (torch.ones(1), torch.ones(1))):
    vc8, scales = fp8_layout(vc8, scales)  # the engine's: V transposed within its blocks, scales in (K, V) pairs
    rotary_kv.qk_norm_rope(q, k, cos_sin, slots, kv_store=(v, kc8, vc8, slots, scales))
    attention.store_kv(k, v, kc8, vc8, slots, scales)
    attention.decode_attention(torch.randn(3, 16, 128, dtype=bf), kc8, vc8, tables, lens, 0.1, kv_scales=scales)
    attention.paged_prefill_attention(torch.randn(3, 16, 128, dtype=bf), kc8, vc8, meta, 0.1, kv_scales=scales)
# MoE at the Qwen3-30B-A3B layer shape (8 of its 128 experts): the router, the decode path, align_blocks and the
# grouped GEMMs in both tilings, with the CUDA tiles (the host code reads no device value, so none has to be real)
cuda = torch.device("cuda")
moe.num_sms = lambda device: 132
moe._gemv_tiles = lambda programs, n, k, device, gated, tiles=moe._gemv_tiles: tiles(programs, n, k, cuda, gated)
moe.grouped_tiles = lambda ppe, n, k, dtype, device: moe_gemm.grouped_tiles(ppe, n, k, dtype, cuda)
w13, w2 = torch.randn(8, 1536, 2048, dtype=bf), torch.randn(8, 2048, 768, dtype=bf)
moe.route(torch.randn(3, 128, dtype=bf), 8, True)
moe.gemv_experts(torch.randn(1, 2048, dtype=bf), w13, w2, torch.rand(1, 8), torch.randint(0, 8, (1, 8)))
for tokens in (1, 64):  # 1 and 64 pairs per expert: row blocks of 16, then 64
    moe.grouped_experts(torch.randn(tokens, 2048, dtype=bf), w13, w2, torch.rand(tokens, 8),
                        torch.randint(0, 8, (tokens, 8)))
# the device n-gram drafts of speculative decoding (no PDL: nothing before it streams weights)
history, i32 = torch.zeros(4, 8192, dtype=torch.int32), torch.int32
for k, lookup_min, lookup_max in ((4, 1, 3), (1, 2, 5)):
    ngram.propose_ngram(history, torch.zeros(4, dtype=i32), torch.arange(4, dtype=i32), k, lookup_min, lookup_max)
print("all compiled")
'''


@pytest.mark.skipif(not RUN, reason="compiles ~20 kernels for sm_90 offline (about two minutes on 2 cores); "
                                    "NANOSERVE_COMPILE_SM90=1 runs it (machines without a GPU should)")
def test_decode_kernels_compile_for_hopper_with_pdl():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and "all compiled" in proc.stdout, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.stdout.count("compiled _gemv_kernel") == 5 + 5 + 1 + 3  # bf16, fp8 weights, then W8A8
    assert proc.stdout.count("fp8 tensor cores") >= 4  # and the table's W8A8 variants
    assert "prefetched" in proc.stdout  # the slices longer than one tile
    assert proc.stdout.count("compiled _grouped_gemm_kernel") == 4  # MoE: gate/up and down, two tilings
    assert proc.stdout.count("compiled _ngram_kernel") == 2
