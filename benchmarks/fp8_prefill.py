"""GPU: the fp8 many-rows product both ways, torch._scaled_mm vs dequantize + bf16 cuBLAS; prints PREFILL_TABLE.

    python benchmarks/fp8_prefill.py OUT.json [--tokens 128 512 1024 2048 4096 8192] [--models ...]

For the decode matrices (qkv, o_proj, gate_up, down; the lm_head only sees one row per sequence in prefill) of
Qwen3-0.6B, Llama-3.1-8B and the SmolLM2-135M shape, at each token count: ms per call of
kernels/fp8.scaled_mm_linear (activations quantized per token + the FP8 tensor cores) and of
kernels/fp8.dequant_linear (a bf16 copy of the weight, then cuBLAS), with bf16 cuBLAS on the unquantized weight
as the reference, and their errors against an fp32 product on the dequantized weight. From the faster method per
(tokens, matrix) it derives the tokens bucket → weight-size table for nanoserve/kernels/fp8.py.
Timing: CUDA events around a batch of calls after warm-up, median of 5 samples.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: nanoserve, benchmarks.common

from benchmarks.common import MODEL_CONFIGS, env_info, head_dim, write_json  # noqa: E402
from nanoserve.kernels import fp8  # noqa: E402

DEFAULT_TOKENS = [128, 512, 1024, 2048, 4096, 8192]
SAMPLES, WARMUP = 5, 3


def shapes(models: list[str]) -> list[dict]:
    out = []
    for model in models:
        cfg = MODEL_CONFIGS[model]
        h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], head_dim(cfg)
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        for layer, n, k in (("qkv", q + 2 * kv, h), ("o_proj", h, q), ("gate_up", 2 * inter, h), ("down", h, inter)):
            out.append({"model": model, "layer": layer, "n": n, "k": k, "weight_bytes": n * k})
    return out


def time_ms(fn, calls: int) -> float:
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(SAMPLES):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def measure(shape: dict, tokens: int) -> dict:
    w = torch.empty(shape["n"], shape["k"], dtype=torch.bfloat16, device="cuda").normal_(0, shape["k"] ** -0.5)
    q, scale = fp8.quantize(w)
    x = torch.randn(tokens, shape["k"], dtype=torch.bfloat16, device="cuda")
    want = x.float() @ fp8.dequantize(q, scale).T
    calls = max(3, min(50, int(2e10 / (2 * tokens * shape["n"] * shape["k"]))))  # ~tens of ms a sample
    row = {**shape, "tokens": tokens, "calls_per_sample": calls}
    for name, fn in ((fp8.SCALED_MM, lambda: fp8.scaled_mm_linear(x, q, scale)),
                     (fp8.DEQUANT, lambda: fp8.dequant_linear(x, q, scale)),
                     ("bf16_cublas", lambda: F.linear(x, w))):
        try:
            out = fn()
            row[f"{name}_rel_err"] = ((out.float() - want).abs().max() / want.abs().max()).item()
            row[f"{name}_ms"] = time_ms(fn, calls)
            row[f"{name}_tflops"] = 2 * tokens * shape["n"] * shape["k"] / row[f"{name}_ms"] / 1e9
        except Exception as exc:  # e.g. _scaled_mm's row-wise path missing from this build
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    timed = [m for m in (fp8.SCALED_MM, fp8.DEQUANT) if f"{m}_ms" in row]
    row["faster"] = min(timed, key=lambda m: row[f"{m}_ms"]) if timed else None
    if "bf16_cublas_ms" in row and row["faster"]:
        row["faster_vs_bf16"] = row["bf16_cublas_ms"] / row[f"{row['faster']}_ms"]
    return row


def derive_table(rows: list[dict]) -> dict[int, list[tuple[float | None, str]]]:
    """Per tokens count: consecutive matrices (by size) with the same faster method share an entry; bounds at the
    geometric middle between groups."""
    table = {}
    for tokens in sorted({r["tokens"] for r in rows}):
        ranked = sorted((r for r in rows if r["tokens"] == tokens and r["faster"]), key=lambda r: r["weight_bytes"])
        groups: list[list[dict]] = []
        for r in ranked:
            if groups and groups[-1][-1]["faster"] == r["faster"]:
                groups[-1].append(r)
            else:
                groups.append([r])
        entries = []
        for group, nxt in zip(groups, groups[1:] + [None]):
            limit = None if nxt is None else round(
                math.sqrt(group[-1]["weight_bytes"] * nxt[0]["weight_bytes"]) / 2**20, 1)
            entries.append((limit, group[0]["faster"]))
        if entries:
            table[tokens] = entries
    return table


def table_source(table: dict) -> str:
    lines = ["PREFILL_TABLE: dict[int, tuple[tuple[float | None, str], ...]] = {"]
    for tokens, entries in table.items():
        items = [f"({limit!r}, {'SCALED_MM' if m == fp8.SCALED_MM else 'DEQUANT'})" for limit, m in entries]
        lines.append(f"    {tokens}: ({', '.join(items)}{',' if len(items) == 1 else ''}),")
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output", type=Path)
    p.add_argument("--tokens", nargs="+", type=int, default=DEFAULT_TOKENS)
    p.add_argument("--models", nargs="+", default=sorted(MODEL_CONFIGS), choices=sorted(MODEL_CONFIGS))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_prefill.py needs a CUDA GPU")
    torch.manual_seed(0)
    report = {"benchmark": "fp8_prefill", "env": env_info(), "table_before": fp8.PREFILL_TABLE, "rows": []}
    print(f"{'model':>13} {'layer':<8} {'N x K':>12} {'tokens':>6} {'scaled_mm':>10} {'dequant':>9} {'bf16':>8}  "
          f"faster (x bf16)", flush=True)
    for shape in shapes(args.models):
        for tokens in args.tokens:
            row = measure(shape, tokens)
            report["rows"].append(row)
            cell = lambda name: f"{row[name + '_ms']:.3f}" if name + "_ms" in row else "err"  # noqa: E731
            print(f"{row['model']:>13} {row['layer']:<8} {row['n']:>6}x{row['k']:<5} {tokens:>6} "
                  f"{cell(fp8.SCALED_MM):>10} {cell(fp8.DEQUANT):>9} {cell('bf16_cublas'):>8}  {row['faster']} "
                  f"(x{row.get('faster_vs_bf16', float('nan')):.2f})", flush=True)
        torch.cuda.empty_cache()
        write_json(args.output, report)
    table = derive_table(report["rows"])
    report["table"] = {str(t): v for t, v in table.items()}
    report["table_source"] = table_source(table)
    write_json(args.output, report)
    print(f"\ntable for nanoserve/kernels/fp8.py:\n{report['table_source']}\nwrote {args.output}", flush=True)


if __name__ == "__main__":
    main()
