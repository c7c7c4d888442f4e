"""GPU check and benchmark of the Triton paged-attention kernels (nanoserve/kernels/attention.py).

    python benchmarks/attention_kernels.py benchmarks/results/attention_kernels.json [--no-sweep]

1. correctness vs torch_ref at realistic sizes (store_kv, decode, prefill with and without a cached
   prefix, decode replayed from a CUDA graph);
2. decode timings (triton.testing.do_bench median, eager and CUDA-graph replay) for the Qwen3-0.6B
   (16 q / 8 kv heads) and Llama-3.1-8B (32 / 8) attention shapes, head_dim 128, bf16, block size 16,
   batch 1/8/32/128 x context 512/4096/32768, as achieved KV bandwidth vs ~4.2 TB/s;
3. prefill timings (torch varlen_attn and the paged Triton kernel);
4. a small sweep of decode tile/warp/split settings, to tune the module constants.

Every case is isolated: a failure is recorded in the JSON and the run goes on. The JSON is rewritten
after every section, so an interrupted run still leaves its results. Takes well under 2 minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from nanoserve.kernels import attention as tk  # noqa: E402
from nanoserve.kernels import reference as torch_ref  # noqa: E402
from nanoserve.kernels._triton import num_sms  # noqa: E402
from nanoserve.model.attention_metadata import AttentionMetadata  # noqa: E402

PEAK_TBPS = 4.2  # achievable HBM3e bandwidth of an H200 (4.8 TB/s on paper)
MODELS = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}  # (q heads, kv heads), head_dim 128
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 4096, 32768)
HEAD_DIM, BLOCK_SIZE, NUM_KV_HEADS = 128, 16, 8
DEV = torch.device("cuda")
DECODE_CHECKS = [  # (model, batch, max context, dtype, block size)
    ("qwen3-0.6b", 8, 4096, torch.bfloat16, 16), ("llama-3.1-8b", 8, 4096, torch.bfloat16, 16),
    ("llama-3.1-8b", 2, 32768, torch.bfloat16, 16), ("qwen3-0.6b", 64, 512, torch.bfloat16, 16),
    ("llama-3.1-8b", 8, 2048, torch.bfloat16, 32), ("llama-3.1-8b", 8, 2048, torch.bfloat16, 8),
    ("llama-3.1-8b", 8, 2048, torch.float16, 16), ("llama-3.1-8b", 8, 2048, torch.float32, 16),
]
PREFILL_CHECKS = [  # (name, cached prefix lengths, new lengths, dtype), llama-3.1-8b heads
    ("prefill_no_prefix", [0, 0, 0, 0, 0], [1, 100, 1024, 2048, 333], torch.bfloat16),
    ("prefill_cached_prefix", [16, 512, 2000, 0, 77], [1, 100, 1024, 2048, 333], torch.bfloat16),
    ("prefill_no_prefix", [0, 0, 0], [1, 700, 1500], torch.float32),
    ("prefill_cached_prefix", [48, 1000, 5], [1, 700, 1500], torch.float16),
]
GRAPH_CHECK = (16, 8192)  # (batch, max context) of the decode replayed from a CUDA graph
PREFILL_BENCH = [("no_prefix", [0] * 4, [2048] * 4), ("cached_prefix", [3072] * 4, [1024] * 4),
                 ("no_prefix", [0] * 16, [512] * 16)]
SWEEP_SHAPES = [(1, 32768), (8, 32768), (128, 4096)]  # (batch, context), llama-3.1-8b heads


def bench_ms(fn) -> dict:
    """Median (and 20/80 percentiles) in ms; do_bench flushes L2 between calls."""
    med, lo, hi = do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8])
    return {"ms": med, "ms_p20": lo, "ms_p80": hi}


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up that compiles it); returns (replay, graph output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def errors(out: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    diff = (out.float() - ref.float()).abs()
    finite = bool(torch.isfinite(out).all())
    max_abs = diff.max().item()
    max_ref = ref.float().abs().max().item()
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / max(max_ref, 1e-6), "finite": finite,
            "ok": finite and bool(torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol))}


class Case:
    """Runs one named case, recording its result or its error, so one failure never stops the run."""

    def __init__(self, results: list, name: str, **params):
        self.results, self.record = results, {"name": name, **params}

    def __enter__(self) -> dict:
        self.start = time.perf_counter()
        return self.record

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.record["wall_s"] = round(time.perf_counter() - self.start, 3)
        if exc is not None:
            self.record["error"] = f"{exc_type.__name__}: {exc}"
            self.record["traceback"] = traceback.format_exception(exc_type, exc, tb)[-3:]
            print(f"  FAILED {self.record['name']}: {self.record['error']}", flush=True)
            torch.cuda.empty_cache()
        self.results.append(self.record)
        return exc_type is not None and issubclass(exc_type, Exception)


# --------------------------------------------------------------------------------------------- inputs


def random_tables(num_seqs: int, blocks_per_seq: int, num_blocks: int) -> torch.Tensor:
    """Distinct shuffled blocks for every sequence, as a fragmented cache would hand them out."""
    ids = torch.randperm(num_blocks - 1, device=DEV)[:num_seqs * blocks_per_seq]
    return ids.view(num_seqs, blocks_per_seq).to(torch.int32)


def small_cache(num_blocks: int, num_kv_heads: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE):
    """Random K/V caches of num_blocks usable blocks plus the reserved dummy block."""
    num_blocks += 1
    k = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, device=DEV, dtype=dtype)
    return k, torch.randn_like(k)


def prefill_inputs(cached: list[int], new: list[int], num_heads: int, dtype: torch.dtype):
    ctx = [c + n for c, n in zip(cached, new)]
    max_blocks = max(triton.cdiv(c, BLOCK_SIZE) for c in ctx)
    k_cache, v_cache = small_cache(len(ctx) * max_blocks, NUM_KV_HEADS, dtype)
    tables = random_tables(len(ctx), max_blocks, k_cache.shape[0])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(DEV)
    seq_of = torch.cat([torch.full((n,), i) for i, n in enumerate(new)]).to(DEV)
    slots = tables[seq_of, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    total = sum(new)
    q = torch.randn(total, num_heads, HEAD_DIM, device=DEV, dtype=dtype)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=dtype)
    v = torch.randn_like(k)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=slots, context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEV),
        block_tables=tables,
        cu_seqlens_q=torch.tensor([0] + new, device=DEV).cumsum(0).to(torch.int32),
        max_seqlen_q=max(new), has_cached_prefix=any(cached),
        query_lens_host=list(new), context_lens_host=ctx)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    return q, k, v, k_cache, v_cache, meta


def causal_flops(cached: list[int], new: list[int], num_heads: int) -> float:
    """QK^T and PV over the visible keys of every new token."""
    keys = sum(n * c + n * (n + 1) / 2 for c, n in zip(cached, new))
    return 4.0 * num_heads * HEAD_DIM * keys


# --------------------------------------------------------------------------------------------- sections


def check_correctness(results: list) -> None:
    scale = HEAD_DIM ** -0.5
    with Case(results, "store_kv", dtype="bfloat16", num_tokens=4096) as r:
        k = torch.randn(4096, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k_cache, v_cache = small_cache(8192 // BLOCK_SIZE, NUM_KV_HEADS, torch.bfloat16)
        slots = torch.randperm((k_cache.shape[0] - 1) * BLOCK_SIZE, device=DEV)[:4096]
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        torch_ref.store_kv(k, v, k_ref, v_ref, slots)
        tk.store_kv(k, v, k_cache, v_cache, slots)
        r["ok"] = bool(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))

    for model, batch, max_ctx, dtype, block_size in DECODE_CHECKS:
        num_heads, num_kv_heads = MODELS[model]
        with Case(results, "decode", model=model, batch=batch, max_context=max_ctx, dtype=str(dtype)[6:],
                  block_size=block_size) as r:
            lens = torch.randint(1, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32)
            lens[0] = max_ctx
            lens[-1] = 1
            blocks = triton.cdiv(max_ctx, block_size)
            k_cache, v_cache = small_cache(batch * blocks, num_kv_heads, dtype, block_size)
            tables = random_tables(batch, blocks, k_cache.shape[0])
            q = torch.randn(batch, num_heads, HEAD_DIM, device=DEV, dtype=dtype)
            out = tk.decode_attention(q, k_cache, v_cache, tables, lens, scale)
            ref = torch_ref.decode_attention(q, k_cache, v_cache, tables, lens, scale)
            r["num_splits"] = tk.decode_num_splits(batch, num_kv_heads, blocks * block_size, num_sms(DEV))
            r.update(errors(out, ref, 2e-2 if dtype == torch.bfloat16 else 5e-3))
            del k_cache, v_cache

    batch, max_ctx = GRAPH_CHECK
    with Case(results, "decode_cuda_graph", model="llama-3.1-8b", batch=batch, max_context=max_ctx) as r:
        num_heads, num_kv_heads = MODELS["llama-3.1-8b"]
        k_cache, v_cache = small_cache(batch * triton.cdiv(max_ctx, BLOCK_SIZE), num_kv_heads, torch.bfloat16)
        tables = random_tables(batch, triton.cdiv(max_ctx, BLOCK_SIZE), k_cache.shape[0])
        lens = torch.ones(batch, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, num_heads, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        replay, out = graphed(lambda: tk.decode_attention(q, k_cache, v_cache, tables, lens, scale))
        lens.copy_(torch.randint(1, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32))  # changed after capture
        replay()
        ref = torch_ref.decode_attention(q, k_cache, v_cache, tables, lens, scale)
        r.update(errors(out, ref, 2e-2))

    for name, cached, new, dtype in PREFILL_CHECKS:
        num_heads = MODELS["llama-3.1-8b"][0]
        with Case(results, name, model="llama-3.1-8b", cached=cached, new=new, dtype=str(dtype)[6:]) as r:
            q, k, v, k_cache, v_cache, meta = prefill_inputs(cached, new, num_heads, dtype)
            r["uses_varlen_attn"] = tk._can_use_varlen(q, k, v, meta)
            ref = torch_ref.prefill_attention(q, k, v, k_cache, v_cache, meta, scale)
            tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
            r.update(errors(tk.prefill_attention(q, k, v, k_cache, v_cache, meta, scale), ref, tol))
            r["paged_kernel"] = errors(tk.paged_prefill_attention(q, k_cache, v_cache, meta, scale), ref, tol)
            r["ok"] = r["ok"] and r["paged_kernel"]["ok"]


def bench_decode(results: list, k_cache: torch.Tensor, v_cache: torch.Tensor, compare_one_split: bool) -> None:
    scale = HEAD_DIM ** -0.5
    sms = num_sms(DEV)
    for model, (num_heads, num_kv_heads) in MODELS.items():
        for batch in BATCHES:
            for ctx in CONTEXTS:
                with Case(results, "decode", model=model, batch=batch, context=ctx) as r:
                    tables = random_tables(batch, ctx // BLOCK_SIZE, k_cache.shape[0])
                    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
                    q = torch.randn(batch, num_heads, HEAD_DIM, device=DEV, dtype=k_cache.dtype)
                    kv_bytes = 2 * batch * ctx * num_kv_heads * HEAD_DIM * k_cache.element_size()
                    r["kv_bytes"] = kv_bytes
                    r["num_splits"] = tk.decode_num_splits(batch, num_kv_heads, ctx, sms)

                    def run(splits=None):
                        return tk.decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits)

                    r["eager"] = bench_ms(run)
                    replay, _ = graphed(run)
                    r["graph"] = bench_ms(replay)
                    for key in ("eager", "graph"):
                        r[key]["tb_per_s"] = kv_bytes / (r[key]["ms"] * 1e-3) / 1e12
                        r[key]["frac_of_peak"] = r[key]["tb_per_s"] / PEAK_TBPS
                    if compare_one_split and r["num_splits"] > 1:
                        replay1, _ = graphed(lambda: run(1))
                        r["graph_one_split_ms"] = bench_ms(replay1)["ms"]
                    if batch == 8 and ctx == 4096:  # the plain-PyTorch path, for scale
                        r["torch_ref_ms"] = bench_ms(lambda: torch_ref.decode_attention(
                            q, k_cache, v_cache, tables, lens, scale))["ms"]
                    g = r["graph"]
                    print(f"  decode {model:13s} B={batch:<4d} ctx={ctx:<6d} splits={r['num_splits']:<3d} "
                          f"eager {r['eager']['ms']:.4f} ms  graph {g['ms']:.4f} ms  "
                          f"{g['tb_per_s']:.2f} TB/s ({100 * g['frac_of_peak']:.0f}%)", flush=True)


def bench_prefill(results: list) -> None:
    scale = HEAD_DIM ** -0.5
    num_heads = MODELS["llama-3.1-8b"][0]
    for name, cached, new in PREFILL_BENCH:
        with Case(results, "prefill_" + name, model="llama-3.1-8b", cached=cached, new=new) as r:
            q, k, v, k_cache, v_cache, meta = prefill_inputs(cached, new, num_heads, torch.bfloat16)
            flops = causal_flops(cached, new, num_heads)
            r["uses_varlen_attn"] = tk._can_use_varlen(q, k, v, meta)
            r["dispatch"] = bench_ms(lambda: tk.prefill_attention(q, k, v, k_cache, v_cache, meta, scale))
            r["paged_kernel"] = bench_ms(lambda: tk.paged_prefill_attention(q, k_cache, v_cache, meta, scale))
            for key in ("dispatch", "paged_kernel"):
                r[key]["tflops"] = flops / (r[key]["ms"] * 1e-3) / 1e12
            r["store_kv"] = bench_ms(lambda: tk.store_kv(k, v, k_cache, v_cache, meta.slot_mapping))
            print(f"  prefill {name:13s} {len(new)}x{new[0]} (+{cached[0]} cached): dispatch "
                  f"{r['dispatch']['ms']:.3f} ms ({r['dispatch']['tflops']:.0f} TFLOP/s, varlen="
                  f"{r['uses_varlen_attn']}), paged kernel {r['paged_kernel']['ms']:.3f} ms "
                  f"({r['paged_kernel']['tflops']:.0f} TFLOP/s)", flush=True)


def sweep_decode(results: list, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Decode time (graph replay) under other module settings; each setting is restored afterwards."""
    scale = HEAD_DIM ** -0.5
    num_heads, num_kv_heads = MODELS["llama-3.1-8b"]
    settings = [{"DECODE_NUM_WARPS": w, "MAX_BLOCK_N": n, "KV_TILE_BYTES": n * HEAD_DIM * 2}
                for w in (4, 8) for n in (32, 64, 128)]
    for batch, ctx in SWEEP_SHAPES:
        tables = random_tables(batch, ctx // BLOCK_SIZE, k_cache.shape[0])
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, num_heads, HEAD_DIM, device=DEV, dtype=k_cache.dtype)
        kv_bytes = 2 * batch * ctx * num_kv_heads * HEAD_DIM * k_cache.element_size()
        base = tk.decode_num_splits(batch, num_kv_heads, ctx, num_sms(DEV))
        variants = [dict(s) for s in settings] + [{"num_splits": n} for n in sorted({1, max(1, base // 2), base * 2})]
        for variant in variants:
            splits = variant.get("num_splits")
            module_settings = {k: v for k, v in variant.items() if k != "num_splits"}
            saved = {k: getattr(tk, k) for k in module_settings}
            with Case(results, "decode_sweep", model="llama-3.1-8b", batch=batch, context=ctx,
                      default_splits=base, **variant) as r:
                try:
                    for key, value in module_settings.items():
                        setattr(tk, key, value)
                    replay, _ = graphed(lambda: tk.decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                                    num_splits=splits))
                    r["graph"] = bench_ms(replay)
                    r["graph"]["tb_per_s"] = kv_bytes / (r["graph"]["ms"] * 1e-3) / 1e12
                finally:
                    for key, value in saved.items():
                        setattr(tk, key, value)
            if "graph" in r:
                print(f"  sweep B={batch:<4d} ctx={ctx:<6d} {variant}: {r['graph']['ms']:.4f} ms "
                      f"{r['graph']['tb_per_s']:.2f} TB/s", flush=True)


# --------------------------------------------------------------------------------------------- main


def environment() -> dict:
    props = torch.cuda.get_device_properties(DEV)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(DEV), "sm_count": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2 ** 30, 1), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "varlen_attn": tk._varlen_attn is not None,
            "varlen_kwargs": {k: str(v) for k, v in tk._VARLEN_KWARGS.items()},
            "peak_tb_per_s_assumed": PEAK_TBPS,
            "decode_settings": {k: getattr(tk, k) for k in ("DECODE_MIN_PARTITION", "DECODE_WAVES", "DECODE_MAX_SPLITS",
                                                            "DECODE_NUM_WARPS", "KV_TILE_BYTES", "MAX_BLOCK_N")}}


def summarize(report: dict) -> dict:
    cases = report["correctness"] + report["decode"] + report["prefill"] + report["sweep"]
    failed = [c for c in report["correctness"] if not c.get("ok")]
    decode = [c for c in report["decode"] if "graph" in c]
    best = max(decode, key=lambda c: c["graph"]["tb_per_s"], default=None)
    return {"correctness_ok": not failed and bool(report["correctness"]),
            "correctness_failed": [{k: c.get(k) for k in ("name", "model", "batch", "error", "max_rel_err")}
                                   for c in failed],
            "errors": sum("error" in c for c in cases),
            "best_decode_tb_per_s": best and round(best["graph"]["tb_per_s"], 3),
            "best_decode_case": best and {k: best[k] for k in ("model", "batch", "context")},
            "decode_frac_of_peak_geomean": decode and math.exp(
                sum(math.log(max(c["graph"]["frac_of_peak"], 1e-9)) for c in decode) / len(decode))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where to write the JSON report")
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode settings sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(), "correctness": [], "decode": [], "prefill": [], "sweep": []}
    start = time.perf_counter()

    def save(stage: str) -> None:
        report["stage_done"] = stage
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        report["summary"] = summarize(report)
        args.output.write_text(json.dumps(report, indent=1, default=str))

    torch.manual_seed(0)
    print(f"{report['environment']['gpu']}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    print("correctness vs torch_ref", flush=True)
    check_correctness(report["correctness"])
    for c in report["correctness"]:
        print(f"  {'ok  ' if c.get('ok') else 'FAIL'} {c['name']} "
              f"{ {k: c[k] for k in ('model', 'batch', 'max_context', 'dtype', 'block_size') if k in c} } "
              f"max_rel_err={c.get('max_rel_err', '-')}", flush=True)
    save("correctness")

    # One cache for every decode shape: 128 x 32768 tokens x 8 kv heads x 128 x bf16 = 8 GiB each for K and V.
    k_cache = v_cache = None
    with Case(report["decode"], "allocate_decode_cache") as r:
        num_blocks = max(BATCHES) * max(CONTEXTS) // BLOCK_SIZE + 1
        k_cache = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        v_cache = torch.empty_like(k_cache)
        k_cache.normal_()
        v_cache.normal_()
        r["gib"] = round(2 * k_cache.numel() * k_cache.element_size() / 2 ** 30, 2)
    if k_cache is not None:
        print("decode (bf16, block 16, head_dim 128; bandwidth from the graph replay)", flush=True)
        bench_decode(report["decode"], k_cache, v_cache, compare_one_split=True)
    save("decode")
    print("prefill (bf16, llama-3.1-8b heads)", flush=True)
    bench_prefill(report["prefill"])
    save("prefill")
    if k_cache is not None and not args.no_sweep:
        print("decode settings sweep (llama-3.1-8b, graph replay)", flush=True)
        sweep_decode(report["sweep"], k_cache, v_cache)
    save("done")
    print(json.dumps(report["summary"], indent=1), flush=True)
    print(f"wrote {args.output} in {report['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
