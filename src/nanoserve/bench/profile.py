"""Where a step's GPU time goes: one call's kernels under torch.profiler, each put in a kind by its name (our Triton
kernels by name, cuBLAS by its markers, the last product of a step as the lm_head), with the time each kind owns.

`nanoserve bench latency --profile` prints it; benchmarks/ (decode_floor.py, moe.py, prompt_latency.py) record it.
Kernels that overlap (programmatic dependent launch lets the next one start early) are counted once: a kind owns
the time from where the kernels before it ended ("busy"), and the kinds' busy times add up to the step's.
"""
from __future__ import annotations

from collections import defaultdict

KINDS = ("gemv", "attention", "attention merge", "norm", "rotary", "experts", "routing", "lm_head", "other")
_NAMED_KINDS = {"_gemv_kernel": "gemv", "_decode_kernel": "attention", "_prefill_kernel": "attention",
                "_decode_reduce_kernel": "attention merge", "_rms_norm_kernel": "norm",
                "_qk_norm_rope_kernel": "rotary", "_store_kv_kernel": "rotary", "_silu_and_mul_kernel": "other",
                # kernels/moe.py: the experts' products, and routing (top-k, sorting pairs into expert blocks)
                "_gemv_gate_up_kernel": "experts", "_gemv_down_kernel": "experts", "_grouped_gemm_kernel": "experts",
                "_route_kernel": "routing", "_align_kernel": "routing", "_sum_pairs_kernel": "experts"}
_CUBLAS_MARKERS = ("nvjet", "gemm", "gemv", "cutlass", "xmma", "splitkreduce", "cublas")


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name; matrix products of cuBLAS count as gemv (lm_head is found by position)."""
    if name in _NAMED_KINDS:
        return _NAMED_KINDS[name]
    lowered = name.lower()
    if "flash" in lowered:  # flash varlen attention (eager prompt steps)
        return "attention"
    return "gemv" if any(m in lowered for m in _CUBLAS_MARKERS) else "other"


def kind_table(kernels: list[tuple[str, float, float]]) -> dict:
    """kernels: (name, start_us, end_us) of one step. Per kind: count, sum_us, busy_us; the last product of the
    step is the lm_head. Also the step's kernel count, span and busy time, and the top kernels by name."""
    kernels = sorted(kernels, key=lambda k: k[1])
    kinds = [kernel_kind(n) for n, _, _ in kernels]
    products = [i for i, kind in enumerate(kinds) if kind == "gemv"]
    if products:
        kinds[products[-1]] = "lm_head"
    table = {kind: {"count": 0, "sum_us": 0.0, "busy_us": 0.0} for kind in KINDS}
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    covered = float("-inf")
    for (name, start, end), kind in zip(kernels, kinds):
        row = table[kind]
        row["count"] += 1
        row["sum_us"] += end - start
        row["busy_us"] += max(0.0, end - max(start, covered))
        covered = max(covered, end)
        by_name[name][0] += 1
        by_name[name][1] += end - start
    busy = sum(r["busy_us"] for r in table.values())
    span = kernels[-1][2] - kernels[0][1] if kernels else 0.0
    top = sorted(((n[:90], c, t) for n, (c, t) in by_name.items()), key=lambda r: -r[2])[:15]
    return {"kernels": len(kernels), "span_us": span, "busy_us": busy, "kinds": table, "top": top}


def profile_step(run) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every kernel of one call of run(), memory copies and sets left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not evt.name.startswith(("Memcpy", "Memset")):
            out.append((evt.name, float(evt.time_range.start), float(evt.time_range.end)))
    return out


def format_kinds(table: dict) -> list[str]:
    """One line per kind that ran: kernels, the µs it owns and its share of the step's busy time."""
    busy = table["busy_us"] or 1.0
    lines = [f"{table['kernels']} kernels, {table['busy_us']:.0f} us busy over a {table['span_us']:.0f} us span"]
    for kind, row in table["kinds"].items():
        if row["count"]:
            share = 100 * row["busy_us"] / busy
            lines.append(f"  {kind:16s} {row['count']:6d} kernels {row['busy_us']:11.0f} us {share:5.1f}%")
    return lines


__all__ = ["KINDS", "format_kinds", "kernel_kind", "kind_table", "profile_step"]
