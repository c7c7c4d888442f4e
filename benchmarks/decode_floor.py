"""Decode against its HBM floor: one measurement truth, each kernel switch's worth in the model, decode attention.

    python benchmarks/decode_floor.py model [--models qwen3-0.6b llama-3.1-8b smollm2-135m]
                                            [--batch-sizes 1 8 32 64 256] [--switch-sizes 1 8 32]
                                            [--switch-sets all no_prefetch no_pdl ...] [--json PATH]
    python benchmarks/decode_floor.py attention [--json PATH]
    python benchmarks/decode_floor.py products [--models ...] [--gemv-rows 1 8 32 64] [--json PATH]

`model`: one engine per model (random bf16 weights, real shapes, a graph per --batch-sizes, contexts of --context
tokens, max_model_len --max-model-len) and, per batch size, the same decode step timed every way this repo has
timed it, so that they can be compared in one run:
  * replay_b2b_ms: the graph replayed back to back between two CUDA events (inputs loaded once) — how the
    engine's steps follow each other;
  * replay_sync_ms: a synchronize before each replay (runner/startup/timing.time_ms: the start-up probes);
  * execute_sync_ms / execute_b2b_ms: runner.execute (input load + replay, no sampling), synchronized or back
    to back (`nanoserve bench graphs` times execute);
  * step_ms: engine.step() back to back with b running requests (sampling, scheduling, outputs), and
    replay_b2b_step_context_ms, the replay after them at their mean context (their requests grow while they run);
    their device timeline (step_timeline: the period between samplers, the events and idle gaps around the graph);
  * floor_ms: weights once + KV ÷ the measured copy bandwidth;
  * the GPU time by kernel kind of one replay (torch.profiler; busy_us gives each stretch of the timeline to the
    kernel that ends it).
At b=1 also `LLM.generate` and `LLM.stream` ms per token. Then, for each switch set (kernels/switches.py, SWITCH_SETS
here), the --switch-sizes graphs are captured again under those switches and replayed back to back, with their
kernel profile and graph edges (benchmarks/graph_edges.py: every PDL kernel after a kernel must hang on a
programmatic edge).

`attention`: the decode attention kernel alone (+ its merge) over b = 1…32 rows and 1k–4k-token contexts, per
split rule, pipeline depth, warps, key tile and an fp8 cache's product dtype (--waves, --stages, --warps,
--block-n, --products): a graph of enough layers' calls that the KV cannot stay in L2,
replayed back to back; GB/s against the copy bandwidth.

`products`: each decode product of a layer alone, bf16 (the table's variant, cuBLAS) against the fp8 candidates, per
rows: distinct weights of the shape in turn in one graph (as the layers follow each other), µs and the weight bytes'
rate against the copy bandwidth.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (Relaunched, back_to_back_seconds, env_info, kv_bytes_per_token,  # noqa
                               measure_copy_bandwidth, model_config, param_counts, release_cuda_memory, text_part,
                               write_json, write_model_dir)
from nanoserve.bench.profile import kernel_kind, kind_table, profile_step  # noqa: E402,F401 (tests read them here)

B2B_ITERS = 50
from nanoserve.kernels.switches import SWITCHES, switched  # noqa: E402

SWITCH_SETS: dict[str, dict[str, bool | int]] = {
    "all": {},  # the defaults (kernels/switches.py)
    "no_pdl": {"pdl": False},
    "no_prefetch": {"gemv_prefetch": False},
    "no_fuse_norm": {"fuse_norm": False},
    "fuse_norm_any_k": {"fuse_norm_min_k": 0, "fuse_norm_max_k": 1 << 20},
    "none": {"pdl": False, "fuse_norm": False, "gemv_prefetch": False, "fuse_max_m": 0},
    "old_rule_1row": {"fuse_norm": False},
}
# Sets that also change the GEMV dispatch: (rows bucket, weight MiB above which cuBLAS runs the plain product).
# "old_rule_1row": the one-row rule before the sweep-made GEMV_TABLE (a fused-norm GEMV is always Triton, so the
# norm is not fused there).
TABLE_SETS = {"old_rule_1row": (1, 160)}
def layer_timeline(kernels: list[tuple[str, float, float]], layer: int, per_layer: int) -> list:
    """One layer's kernels (name, start, end µs from the layer's first start): where the gaps and overlaps are."""
    kernels = sorted(kernels, key=lambda k: k[1])[1 + layer * per_layer:1 + (layer + 1) * per_layer]
    t0 = kernels[0][1] if kernels else 0.0
    return [(n[:40], round(s - t0, 2), round(e - t0, 2)) for n, s, e in kernels]


@contextlib.contextmanager
def kept_graphs():
    """Graphs created meanwhile keep their cudaGraph_t (keep_graph=True), so their edges can be read."""
    make = torch.cuda.CUDAGraph
    try:
        make(keep_graph=True)
    except TypeError:  # an older torch: no edge check
        yield False
        return
    with mock.patch.object(torch.cuda, "CUDAGraph", lambda *a, **k: make(*a, **{**k, "keep_graph": True})):
        yield True


@contextlib.contextmanager
def table_patched(name: str):
    """For a TABLE_SETS name: GEMV_TABLE's entries of that rows bucket with cuBLAS above the size (else as is)."""
    from nanoserve.kernels import gemv

    if name not in TABLE_SETS:
        yield
        return
    rows, mib = TABLE_SETS[name]
    limit, entries = mib * 2**20, []
    for size, cfg, triton in gemv._TABLE[rows]:
        if size > limit and (not entries or entries[-1][0] < limit):
            entries.append((limit, cfg, triton))
        entries.append((size, cfg, triton and size <= limit))
    with mock.patch.dict(gemv._TABLE, {rows: tuple(entries)}):
        yield


def _decode_graphs(runner):
    """The runner's decode graphs (runner/dispatch.py's table)."""
    from nanoserve.runner.dispatch import Kind

    return runner.graphs.runners[Kind.DECODE]


def graph_edges(graph_runner, sizes: list[int]) -> dict:
    from benchmarks.graph_edges import inspect_graph

    out = {}
    for b in sizes:
        try:
            out[str(b)] = inspect_graph(graph_runner.graphs[b].raw_cuda_graph()).as_dict()
        except Exception as exc:
            out[str(b)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def b2b_ms(fn, iters: int = B2B_ITERS, repeats: int = 3) -> float:
    """Median over repeats of ms per call, iters calls queued back to back between two events."""
    return statistics.median(back_to_back_seconds(fn, iters) * 1e3 / iters for _ in range(repeats))


def floor_ms(cfg: dict, b: int, context: int, bandwidth: float, fp8: bool = False, fp8_head: bool = False) -> float:
    """Weights read once (the lm_head matrix whole, b embedding rows when it is not tied; the decoder layers' linear
    weights one byte each with fp8, and the lm_head's with fp8_head) + KV, at bandwidth."""
    p, text = param_counts(cfg), text_part(cfg)
    head = text["vocab_size"] * text["hidden_size"]
    weight_params = p.layers + p.final_norm + head + (b * text["hidden_size"] if p.lm_head else 0)
    fp8_params = sum(n * k for n, k in decode_shapes(cfg).values()) * text["num_hidden_layers"] if fp8 else 0
    fp8_params += head if fp8 and fp8_head else 0
    return (2 * weight_params - fp8_params + b * context * kv_bytes_per_token(cfg)) / bandwidth * 1e3


def time_bucket(runner, b: int, context: int) -> dict:
    """One decode step of b rows timed every way (see the module docstring), and its kernel profile."""
    from nanoserve.bench.decode_step import decode_batch, time_decode_step
    from nanoserve.runner.startup.timing import time_ms

    gr, batch = _decode_graphs(runner), decode_batch(runner, b, context)
    rec = {"execute_sync_ms": statistics.median(time_decode_step(runner, batch, 5, 30)),
           "execute_b2b_ms": b2b_ms(lambda: runner.execute(batch))}
    runner.buffers.decode_forward.load(batch, b)
    rec["replay_sync_ms"] = statistics.median(time_ms(lambda: gr.replay(b), runner.device, 5, 30))
    rec["replay_b2b_ms"] = b2b_ms(lambda: gr.replay(b))
    kernels = profile_step(lambda: gr.replay(b))
    rec.update(kind_table(kernels))
    rec["layer_timeline"] = layer_timeline(kernels, runner.model.num_layers // 2, _kernels_per_layer(kernels, runner))
    return rec


def _kernels_per_layer(kernels, runner) -> int:
    return max(1, (len(kernels) - 3) // runner.model.num_layers)


def engine_steps(llm, b: int, context: int, steps: int = 30, runs: int = 3) -> dict:
    """engine.step() back to back with b running requests after their prefill: ms per step (median of runs)."""
    from nanoserve import SamplingParams

    engine, device = llm.engine.core, llm.engine.core.runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    vocab = engine.vocab_size
    # (the first prompts decode while the last prefill: every request must outlast the timed steps)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(200, 8 * (runs * steps + 8)))
    gen = torch.Generator().manual_seed(1000 + b)
    ids = [f"steps-{b}-{i}" for i in range(b)]
    for rid in ids:
        llm.engine.add_request(rid, torch.randint(0, vocab, (context,), generator=gen).tolist(), params)
    try:
        for _ in range(4 * b + 64):  # until every request decodes (the front end hands requests over in step())
            running = engine.scheduler.running
            if len(running) == b and all(s.decoding for s in running):
                break
            llm.engine.step()
        for _ in range(5):
            llm.engine.step()
        samples, rows, contexts = [], set(), []
        for _ in range(runs):
            sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                running = engine.scheduler.running
                rows.add(len(running))
                contexts.append(sum(s.num_tokens for s in running) / max(1, len(running)))
                llm.engine.step()
            sync(device)
            samples.append((time.perf_counter() - t) * 1e3 / steps)
        return {"step_ms": statistics.median(samples), "step_samples_ms": samples, "rows_seen": sorted(rows),
                "step_context": round(statistics.mean(contexts)), **step_timeline(llm.engine.step)}
    finally:
        for rid in ids:
            llm.engine.abort_request(rid)
        while engine.has_unfinished_requests():
            llm.engine.step()


def step_timeline(step, steps: int = 12) -> dict:
    """The device timeline of engine steps back to back: the period between two samplers, and each step's events
    outside its decode graph's kernels (copies, the sampler, the seed's increment) with the idle gap before each:
    what a step costs the device beyond its replay."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ev = sorted(((e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e[1])
    ends = [i for i, e in enumerate(ev) if e[0].startswith("_sample_kernel")]
    if len(ends) < 4:
        return {}
    periods = [ev[b][1] - ev[a][1] for a, b in zip(ends[1:-1], ends[2:])]
    a, b = ends[len(ends) // 2 - 1], ends[len(ends) // 2]
    one = ev[a:b + 1]
    around = [(n[:40], round(s0 - p[2], 1), round(e0 - s0, 1)) for p, (n, s0, e0) in zip(one, one[1:])
              if not n.startswith("_") or n.startswith("_sample") or s0 - p[2] > 1.5]
    return {"step_device_period_us": statistics.median(periods), "step_events_outside_graph": around,
            "step_idle_us": sum(max(0.0, y[1] - x[2]) for x, y in zip(one, one[1:]))}


def replay_at_step_context(runner, b: int, rec: dict) -> dict:
    """The graph replayed back to back at the engine steps' mean context (their requests grew while they ran, and
    at large b the KV they read is a large part of the step): the replay step_ms compares with."""
    from nanoserve.bench.decode_step import decode_batch

    runner.buffers.decode_forward.load(decode_batch(runner, b, rec["step_context"]), b)
    ms = b2b_ms(lambda: _decode_graphs(runner).replay(b))
    return {"replay_b2b_step_context_ms": ms, "step_over_replay": rec["step_ms"] / ms}


def offline_b1(llm, context: int, tokens: int = 129) -> dict:
    """LLM.generate and LLM.stream at one request: ms per generated token after the first."""
    from nanoserve import SamplingParams

    prompt = list(range(1, context + 1))
    one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    many = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
    llm.generate([prompt], one, use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], many, use_tqdm=False)
    generate = (time.perf_counter() - t - first) * 1e3 / (tokens - 1)
    stamps = [time.perf_counter() for _ in llm.stream(prompt, many)]
    return {"generate_ms_per_token": generate, "stream_ms_per_token": (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)}


def measure_switch_set(runner, name: str, sizes: list[int], context: int) -> dict:
    """The sizes' graphs captured again under the switch set: replay back to back, kernel profile, edges."""
    from nanoserve.bench.decode_step import decode_batch

    rec: dict = {"switches": {}, "buckets": {}}
    try:
        with switched(**SWITCH_SETS[name]), table_patched(name), kept_graphs() as kept:
            rec["switches"] = dict(SWITCHES.__dict__)
            gr = _decode_graphs(runner)
            gr.drop(sizes)
            gr.capture(sizes)
            rec["edges"] = graph_edges(gr, sizes) if kept else {"error": "torch has no keep_graph"}
            for b in sizes:
                runner.buffers.decode_forward.load(decode_batch(runner, b, context), b)
                kernels = profile_step(lambda: gr.replay(b))
                rec["buckets"][str(b)] = {"replay_b2b_ms": b2b_ms(lambda: gr.replay(b)), **kind_table(kernels)}
    except Exception as exc:  # one failing set must not lose the others
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    return rec


def measure_model(name: str, args, bandwidth: float, report: dict) -> dict:
    from nanoserve import LLM

    cfg, sizes = model_config(name), sorted(set(args.batch_sizes))
    result: dict = {"buckets": {}, "sets": {}}
    report["models"][name + (f" {args.quantization}" if args.quantization else "") + (" blocks" if args.fp8_block
                             else "") + (" lm_head" if args.quantize_lm_head else "")] = result
    with tempfile.TemporaryDirectory() as tmp, fp8_blocks(args.fp8_block):
        t = time.perf_counter()
        llm = LLM(str(write_model_dir(cfg, tmp)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_num_seqs=max(sizes), max_model_len=args.max_model_len, cudagraph_capture_sizes=sizes,
                  prefill_graph_sizes="off", num_kv_blocks=max(sizes) * (args.context // 16 + 16) + 64,
                  enable_prefix_caching=False, show_progress=False, quantization=args.quantization,
                  quantize_lm_head=args.quantize_lm_head)
        result["startup_s"] = time.perf_counter() - t
        runner = llm.engine.core.runner
        if args.prefill:
            _guarded(result, lambda: result.update(prefill=prefill_tokens_per_s(llm)))
            print(f"== {name} prefill 8 x 1024: {result.get('prefill')}", flush=True)
            if args.quantization == "fp8" and args.gemv_rows:  # with the sweep: PREFILL_TABLE's source
                _guarded(result, lambda: result.update(prefill_products=prefill_products(cfg)))
        for b in sizes:
            rec = result["buckets"][str(b)] = {"floor_ms": floor_ms(cfg, b, args.context, bandwidth,
                                                                    args.quantization == "fp8", args.quantize_lm_head)}
            _guarded(rec, lambda: rec.update(time_bucket(runner, b, args.context)))
            _guarded(rec, lambda: rec.update(engine_steps(llm, b, args.context)))
            _guarded(rec, lambda: rec.update(replay_at_step_context(runner, b, rec)))
            print_bucket(name, b, rec)
        _guarded(result, lambda: result.update(offline=offline_b1(llm, args.context)))
        print(f"== {name} offline b=1: {result.get('offline')}", flush=True)
        write_json(args.json, report) if args.json else None
        if args.gemv_rows:
            _guarded(result, lambda: result.update(gemv=gemv_sweep(runner, cfg, args.gemv_rows, args.context,
                                                                   args.quantization == "fp8")))
            write_json(args.json, report) if args.json else None
        for set_name in args.switch_sets:
            result["sets"][set_name] = rec = measure_switch_set(runner, set_name, args.switch_sizes, args.context)
            print_set(name, set_name, rec)
            write_json(args.json, report) if args.json else None
        llm.close()
        del llm, runner
        release_cuda_memory()
    return result


def _guarded(rec: dict, fn) -> None:
    try:
        fn()
    except Exception as exc:  # one failing measurement must not lose the others
        rec.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()


def print_bucket(model: str, b: int, r: dict) -> None:
    cells = "  ".join(f"{k[:-3]} {r[k]:.3f}" for k in ("replay_b2b_ms", "replay_sync_ms", "execute_b2b_ms",
                                                       "execute_sync_ms", "step_ms", "replay_b2b_step_context_ms",
                                                       "floor_ms") if k in r)
    kinds = "  ".join(f"{k} {v['count']}x {v['busy_us']:.0f}" for k, v in r.get("kinds", {}).items() if v["count"])
    device = (f"\n     step on the device: period {r['step_device_period_us']:.1f} µs, idle {r['step_idle_us']:.1f} µs; "
              f"outside the graph (name, gap before, µs): {r['step_events_outside_graph']}") \
        if "step_device_period_us" in r else ""
    print(f"== {model} b={b}: {cells}\n     busy µs {r.get('busy_us', 0):.0f}: {kinds} {r.get('errors', '')}{device}",
          flush=True)


def print_set(model: str, set_name: str, rec: dict) -> None:
    if "error" in rec:
        print(f"== {model} [{set_name}]: error {rec['error']}", flush=True)
        return
    for b, r in rec["buckets"].items():
        edges = rec.get("edges", {}).get(b, {})
        pdl = (f"{edges['programmatic_edges']} PDL edges, {edges['pdl_kernels_without_programmatic_edge']} missing"
               if "programmatic_edges" in edges else f"edges: {edges.get('error', '-')}")
        kinds = "  ".join(f"{k} {v['count']}x {v['busy_us']:.0f}" for k, v in r["kinds"].items() if v["count"])
        print(f"== {model} b={b} [{set_name}]: replay {r['replay_b2b_ms']:.3f} ms, {r['kernels']} kernels, busy "
              f"{r['busy_us'] / 1000:.3f} ms; {pdl}\n     busy µs: {kinds}", flush=True)


def summary_rows(report: dict) -> list[dict]:
    """One row per (model, b): replay ms per switch set, kernels per step (all vs none), checks."""
    rows = []
    for model, m in report["models"].items():
        sets = m.get("sets", {})
        sizes = sorted({int(b) for s in sets.values() for b in s.get("buckets", {})})
        for b in sizes:
            row = {"model": model, "b": b, "replay_ms": {}, "kernels": {}}
            for set_name, s in sets.items():
                r = s.get("buckets", {}).get(str(b))
                if r:
                    row["replay_ms"][set_name], row["kernels"][set_name] = r["replay_b2b_ms"], r["kernels"]
            edges = sets.get("all", {}).get("edges", {}).get(str(b), {})
            row["pdl_edges_ok"] = bool(edges.get("programmatic_edges")) and not edges.get(
                "pdl_kernels_without_programmatic_edge") if "programmatic_edges" in edges else None
            rows.append(row)
    return rows


def print_summary(rows: list[dict], sets: list[str]) -> None:
    print("\nreplay ms per decode step (back to back) by switch set; kernels per step; checks")
    print(f"{'model':<14}{'b':>4} " + "".join(f"{s:>15}" for s in sets) + f"{'kernels':>12} {'PDL edges':>10}")
    for r in rows:
        cells = "".join(f"{r['replay_ms'][s]:15.3f}" if s in r["replay_ms"] else f"{'-':>15}" for s in sets)
        kernels = f"{r['kernels'].get('all', '-')}/{r['kernels'].get('none', '-')}"
        print(f"{r['model']:<14}{r['b']:>4} {cells}{kernels:>12} {str(r['pdl_edges_ok']):>10}")


# -- the GEMV variants in the model ----------------------------------------------------------------------------
GEMV_CANDIDATES = {  # (tiles of 512 or 256 along K divide hidden 2560 and 3072; 1024 leaves a masked last tile)
    1: ["fma 2x1024 w4 st2 p0", "fma 4x1024 w4 st3 p0", "fma 8x1024 w4 st2 p0", "fma 8x512 w4 st3 p0",
        "fma 16x256 w4 st4 p0", "fma 4x512 w2 st3 p0", "fma 8x1024 w8 st2 p0", "fma 4x1024 w4 st3 p2",
        "fma 4x512 w4 st4 p0", "fma 8x512 w4 st4 p0", "fma 16x512 w8 st3 p0", "fma 2x512 w4 st4 p0",
        "fma 4x512 w2 st4 p0", "fma 2x512 w2 st4 p0", "fma 8x512 w2 st3 p0", "fma 4x256 w2 st4 p0",
        "fma 8x256 w4 st4 p0", "fma 2x1024 w2 st3 p0", "fma 2x2048 w4 st2 p0", "fma 1x1024 w2 st3 p0"],
    8: ["dot 64x128 w4 st4 p0", "dot 32x256 w4 st3 p1", "dot 16x512 w4 st3 p1", "dot 64x256 w4 st3 p1",
        "dot 128x128 w8 st3 p0", "dot 32x128 w4 st4 p2", "dot 16x256 w4 st4 p2", "dot 64x64 w4 st4 p2",
        # verification's 5-8 rows (issue 38): the one-row kernels' tiles, rows unrolled on CUDA cores, and narrow dots
        "fma 4x1024 w4 st3 p0", "fma 8x512 w4 st3 p0", "fma 4x512 w4 st4 p0", "fma 2x1024 w4 st3 p0",
        "dot 16x512 w4 st3 p0", "dot 16x256 w4 st4 p1", "dot 32x256 w4 st3 p0", "cublas"],
    # a b = 1 verification of 4 drafts (SmolLM2's latency-bound products): the 8-row dots, unsplit dots with more
    # programs (narrow N tiles) and K tiles that divide SmolLM2's hidden 576 (9 x 64). fmaw (rows unrolled on CUDA
    # cores, each with the one-row kernel's accumulator) lost or tied every product here on the H200 and the H100 and
    # at Llama's shapes: deleted (notes/PERF.md round 9, sixth session)
    5: ["dot 64x128 w4 st4 p0", "dot 64x64 w4 st4 p2", "cublas",
        "dot 16x64 w4 st4 p0", "dot 32x64 w4 st4 p0", "dot 64x64 w4 st4 p0", "dot 16x128 w4 st4 p0",
        "dot 32x128 w4 st4 p0", "dot 16x256 w4 st4 p0", "dot 32x256 w4 st3 p0", "dot 16x128 w2 st4 p0",
        "dot 32x64 w2 st4 p0", "dot 64x128 w4 st4 p1",
        # and Llama-3.1-8B's bandwidth-bound products at 5 rows: more bytes in flight (deeper pipelines, more programs)
        "dot 64x128 w4 st6 p0", "dot 64x128 w4 st6 p1", "dot 64x128 w4 st5 p2", "dot 64x64 w4 st8 p2",
        "dot 64x64 w4 st6 p1", "dot 128x64 w4 st6 p1", "dot 64x256 w4 st4 p1", "dot 128x128 w4 st4 p1",
        "dot 64x128 w8 st6 p1", "dot 32x256 w4 st4 p1", "dot 64x128 w4 st4 p2"],
    16: ["dot 64x128 w4 st4 p0", "dot 64x128 w4 st4 p1", "dot 64x128 w4 st4 p2", "dot 32x256 w4 st3 p1",
         "dot 32x256 w4 st3 p2", "dot 16x512 w4 st3 p2", "dot 32x128 w4 st4 p2", "dot 64x64 w4 st4 p2",
         "dot 128x128 w8 st3 p1", "dot 64x256 w4 st3 p1", "cublas", "dot 32x128 w4 st4 p1",
         "dot 64x128 w4 st6 p1", "dot 64x64 w4 st4 p1", "dot 64x64 w4 st6 p2", "dot 128x64 w4 st4 p1"],
}


# fp8 weights: W8A16 (fma: the weight converted in registers) against W8A8 (dot8q: x quantized by the kernel before
# the product, which runs on FP8 tensor cores; a wgmma needs block_n >= 64)
FP8_CANDIDATES = {  # "cublas": the library path (kernels/fp8.py: x quantized per token, torch._scaled_mm)
    1: ["fma 8x1024 w4 st3 p0", "fma 16x512 w4 st4 p0", "fma 4x1024 w4 st4 p0", "fma 8x1024 w4 st5 p0",
        "dot8q 128x128 w4 st4 p1"],
    8: ["dot8q 64x128 w4 st4 p1", "dot8q 128x128 w4 st4 p1", "dot8q 128x128 w4 st6 p1", "dot8q 64x128 w4 st6 p2",
        "dot8q 64x128 w4 st4 p4", "dot8q 128x128 w8 st3 p1", "cublas"],
}
FP8_CANDIDATES[32] = FP8_CANDIDATES[64] = FP8_CANDIDATES[8]


@contextlib.contextmanager
def fp8_blocks(on: bool):
    """--fp8-block: `quantization="fp8"` quantizes per 128x128 block (as block-quantized checkpoints store it)."""
    from nanoserve.model import quantization

    if not on:
        yield
        return
    quantize = quantization.fp8.quantize
    with mock.patch.object(quantization.fp8, "quantize", lambda w, block=None: quantize(w, (128, 128))):
        yield


def prefill_tokens_per_s(llm, prompts: int = 8, tokens: int = 1024, runs: int = 3) -> dict:
    """8 prompts of 1024 random token ids through LLM.generate (one token each): prompt tokens per second, median of
    runs after a warm-up."""
    from nanoserve import SamplingParams

    one, gen, rates = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1), torch.Generator(), []
    for run in range(runs + 1):
        gen.manual_seed(run)
        batch = [torch.randint(0, llm.engine.core.vocab_size, (tokens,), generator=gen).tolist() for _ in range(prompts)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(batch, one, use_tqdm=False)
        rates.append(prompts * tokens / (time.perf_counter() - t)) if run else None
    return {"tokens_per_s": statistics.median(rates), "samples": rates}


def graph_ms(fn, calls: int = 10) -> float:
    """ms per call of fn, captured `calls` times in a CUDA graph replayed back to back (no host launch cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = b2b_ms(graph.replay, iters=10) / calls
    del graph
    return ms


def prefill_products(cfg: dict, tokens_list=(128, 512, 2048, 8192)) -> dict:
    """Each decode matrix times T prompt rows: bf16 F.linear against the two fp8 methods of kernels/fp8.py (x
    quantized per token + torch._scaled_mm; dequantize + bf16 matmul), ms per product: PREFILL_TABLE's source."""
    import torch.nn.functional as F

    from nanoserve.kernels import fp8

    out = {}
    for name, (n, k) in decode_shapes(cfg).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        q, scale = fp8.quantize(w)
        for t in tokens_list:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            rec = out[f"{name} {n}x{k} T={t}"] = {
                "bf16": graph_ms(lambda: F.linear(x, w)),
                **{m: graph_ms(lambda m=m: fp8.linear(x, q, scale, method=m)) for m in (fp8.SCALED_MM, fp8.DEQUANT)},
                "quantize_rows": graph_ms(lambda: fp8.quantize_rows(x))}
            print(f"== prefill {name} {n}x{k} T={t}: " + ", ".join(f"{m} {v:.3f}" for m, v in rec.items()), flush=True)
            del x
        del w, q
    return out


def decode_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode product of a layer, as the GEMV dispatch sees them (a multimodal config's text model)."""
    cfg = text_part(cfg)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or \
        cfg["hidden_size"] // cfg["num_attention_heads"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter)}


@contextlib.contextmanager
def choice_patched(choices: dict[tuple[int, int, int], str], buckets=GEMV_CANDIDATES):
    """gemv.choose returns choices[(rows bucket, N, K)] (as a Triton win) where given."""
    from nanoserve.kernels import gemv

    original = gemv.choose

    def choose(m, n, k, element_size):
        bucket = min(b for b in buckets if b >= m) if m <= max(buckets) else None
        cfg = choices.get((bucket, n, k))
        if cfg == "cublas":
            return original(m, n, k, element_size)[0], False
        return (gemv.GemvConfig.parse(cfg), True) if cfg else original(m, n, k, element_size)

    with mock.patch.object(gemv, "choose", choose):
        yield


def gemv_sweep(runner, cfg: dict, rows_list: list[int], context: int, fp8: bool = False) -> dict:
    """Per rows bucket and decode product: the b-row graph's replay with each candidate for that product (the others
    as the table says), then with every product's best."""
    from nanoserve.bench.decode_step import decode_batch

    candidates = FP8_CANDIDATES if fp8 else GEMV_CANDIDATES

    def replay(b: int, choices: dict) -> float:
        with choice_patched(choices, candidates):
            _decode_graphs(runner).drop([b])
            _decode_graphs(runner).capture([b])
        runner.buffers.decode_forward.load(decode_batch(runner, b, context), b)
        return b2b_ms(lambda: _decode_graphs(runner).replay(b))

    out = {}
    for b in rows_list:
        rec = out[str(b)] = {"table_ms": replay(b, {}), "products": {}}
        best = {}
        for name, (n, k) in decode_shapes(cfg).items():
            times = {c: replay(b, {(b, n, k): c}) for c in candidates[b]}
            rec["products"][name] = {"n": n, "k": k, "ms": times}
            best[(b, n, k)] = min(times, key=times.get)
            print(f"== gemv b={b} {name} {n}x{k}: table {rec['table_ms']:.3f}; " +
                  ", ".join(f"{c} {t:.3f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])[:3]), flush=True)
        rec["best"] = {f"{n}x{k}": c for (_, n, k), c in best.items()}
        rec["best_ms"] = replay(b, best)
        replay(b, {})  # the table's graph again
        print(f"== gemv b={b}: table {rec['table_ms']:.3f} ms, every product's best {rec['best_ms']:.3f} ms", flush=True)
    return out


# -- each decode product alone ----------------------------------------------------------------------------------
PRODUCT_STREAM_BYTES = 768 * 2**20  # weight bytes per graph replay: copies of one shape, L2 (50 MB) holds none of it
# Candidates of the product sweep beyond FP8_CANDIDATES': larger tiles for one fp8 row (the same bytes in flight as
# bf16's 8x1024) and deeper pipelines / other splits for W8A8.
PRODUCT_EXTRA = {1: ["fma 16x1024 w8 st3 p0", "fma 8x2048 w8 st3 p0", "fma 4x1024 w4 st6 p0", "fma 2x1024 w4 st4 p0",
                     "fma 4x2048 w4 st3 p0", "dot8q 64x128 w4 st6 p2"],
                 8: ["dot8q 128x128 w4 st8 p1", "dot8q 64x128 w4 st8 p2", "dot8q 128x128 w8 st4 p2",
                     "dot8q 256x128 w8 st3 p1", "dot8q 128x64 w4 st8 p2"]}


def product_point(n: int, k: int, m: int, fp8_weight: bool, candidates: list[str], bandwidth: float,
                  norm: bool = False) -> dict:
    """One [n, k] product of m rows, `copies` distinct weights in turn in one CUDA graph (PDL launches follow each other
    as in a layer): per candidate (a GemvConfig, "table" = GEMV_TABLE's, "cublas" = the library path) µs per product
    and the weight bytes' rate as a fraction of the copy bandwidth. With norm each product follows the RMSNorm that
    makes its input, as qkv and gate_up do in a layer (quantizing for a dot8q variant): the µs are the pair's."""
    from nanoserve.kernels import fp8, fused, gemv

    size = 1 if fp8_weight else 2
    copies = max(4, min(64, -(-PRODUCT_STREAM_BYTES // (n * k * size))))
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = fp8.quantize_activations(x)
    weights = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        weights.append(fp8.quantize(w) if fp8_weight else (w, None))
        del w
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)

    def produced(quantize: bool):  # the product's input: made by a norm launch of its own, or the one made above
        return (lambda: fused.rms_norm(x, norm_w, 1e-6, quantize=quantize)) if norm else \
            (lambda: rows if quantize else x)

    out = {}
    for cand in candidates:
        if cand == "cublas":
            make = produced(False)
            launch = lambda w, s: gemv._library_linear(make(), w, None, s)  # noqa: E731
        else:
            cfg = gemv.choose(m, n, k, size)[0] if cand == "table" else gemv.GemvConfig.parse(cand)
            make = produced(cfg.act_fp8)
            launch = lambda w, s, cfg=cfg, make=make: gemv._launch(make(), w, None, k, cfg, weight_scale=s)  # noqa
        try:
            us = graph_ms(lambda: [launch(w, s) for w, s in weights], calls=1) * 1e3 / copies
        except Exception as exc:  # a variant this shape cannot take
            out[cand] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        out[cand] = {"us": us, "of_copy_bw": n * k * size / (us * 1e-6) / bandwidth}
    del weights
    release_cuda_memory()
    return out


def products_sweep(args, bandwidth: float) -> dict:
    """Per model, decode product and rows: bf16 (the table's variant, cuBLAS) and fp8 (FP8_CANDIDATES + PRODUCT_EXTRA)."""
    report = {}
    for name in args.models:
        for prod, (n, k) in decode_shapes(model_config(name)).items():
            for m in args.gemv_rows or [1, 8, 32, 64]:
                bucket = min(b for b in FP8_CANDIDATES if b >= m)
                fp8_cands = FP8_CANDIDATES[bucket] + PRODUCT_EXTRA.get(bucket, PRODUCT_EXTRA[8]) + ["table"]
                norm = args.after_norm and prod in ("qkv", "gate_up")
                rec = report[f"{name} {prod} {n}x{k} m={m}" + (" after norm" if norm else "")] = {
                    "bf16": product_point(n, k, m, False, ["table", "cublas"], bandwidth, norm),
                    "fp8": product_point(n, k, m, True, list(dict.fromkeys(fp8_cands)), bandwidth, norm)}
                best = sorted((v["us"], c) for c, v in rec["fp8"].items() if "us" in v)[:3]
                print(f"== product {name} {prod} {n}x{k} m={m}{' after norm' if norm else ''}: bf16 table {rec['bf16']['table'].get('us', 0):.1f} "
                      f"us ({rec['bf16']['table'].get('of_copy_bw', 0):.0%}); fp8 table "
                      f"{rec['fp8']['table'].get('us', 0):.1f}; best " +
                      ", ".join(f"{c} {us:.1f} ({rec['fp8'][c]['of_copy_bw']:.0%})" for us, c in best), flush=True)
    return report


# -- decode attention alone ------------------------------------------------------------------------------
ATTENTION_SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128),  # heads, kv heads, head_dim
                    "qwen3-30b-a3b": (32, 4, 128)}
L2_DEFEAT_BYTES = 256 * 2**20  # KV per replay, over all layers: several times the H200's 50 MB L2


KV_FORMATS = ("bf16", "fp8-token", "fp8-layer")  # the cache formats (kernels/kv_quant.py)


def attention_point(shape, b: int, context: int, rule: dict, bandwidth: float, table_tokens: int,
                    kv_format: str = "bf16") -> dict:
    """Per-layer µs and bandwidth of decode attention (+ merge) for b rows of `context` tokens under one rule:
    {"waves": w} (the split rule with DECODE_WAVES = w), {"stages": s} (the format's pipeline depth), {"warps": n},
    {"block_n": n} (the key tile; 0: the kernel's rule), {"products": "fp16" | "bf16"} (an fp8 cache's product
    dtype), {"lanes": "off" | "RxLxW"} (an fp8 cache's CUDA-core kernel), {"tail": 0 | 1} (an fp8 cache read with
    the engine's exact tail) and {"gluon": "WxSxR"} (attention_sm90's warps, stages and register cap, 0: none), over a
    cache of kv_format (KV_FORMATS) in the engine's layout and block size; bytes per token from its KVCacheSpec."""
    from nanoserve.config import DEFAULT_BLOCK_SIZE, FP8_BLOCK_SIZE
    from nanoserve.kernels import attention as A
    from nanoserve.kernels import attention_sm90, kv_quant
    from nanoserve.runner.kv_cache import KVCacheSpec, fp8_layout

    heads, kv_heads, d = shape
    fp8 = kv_format != "bf16"
    block = FP8_BLOCK_SIZE if fp8 else DEFAULT_BLOCK_SIZE
    spec = KVCacheSpec(1, kv_heads, d, block, kv_quant.FP8_DTYPE if fp8 else torch.bfloat16,
                       kv_format.removeprefix("fp8-") if fp8 else None)
    per_layer = b * context * spec.bytes_per_token
    layers = max(4, min(64, -(-L2_DEFEAT_BYTES // per_layer)))
    blocks = b * (context // block)
    k = torch.randn(layers * blocks + 1, block, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scales = None
    if fp8:
        layer_scale = None if spec.scales == "token" else torch.ones(1, device="cuda")
        (k, ks), (v, vs) = (kv_quant.quantize_ref(x, layer_scale) for x in (k, v))
        v, scales = fp8_layout(v, (ks, vs))
    width = table_tokens // block
    tables = [torch.full((b, width), layers * blocks, dtype=torch.int32, device="cuda") for _ in range(layers)]
    for layer, t in enumerate(tables):
        t[:, :context // block] = (layer * blocks + torch.arange(blocks, device="cuda", dtype=torch.int32)).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
    tail = {}
    if fp8 and rule.get("tail"):  # the engine's exact tail: each row's own block read in bf16 from its slot's rows
        from nanoserve.kernels.kv_quant import TAIL_BANKS
        tail = {"kv_tail": tuple(torch.randn(b * TAIL_BANKS * block, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                                 for _ in range(2)), "slots": torch.arange(b, device="cuda", dtype=torch.int32)}
    call = lambda t: A.decode_attention(q, k, v, t, lens, d ** -0.5, kv_scales=scales, **tail)  # noqa: E731
    default_out = call(tables[0])
    compiled = {}
    with contextlib.ExitStack() as patches:
        for module, names in ((A, _attention_patches(A, rule)), (attention_sm90, _gluon_patches(rule, compiled))):
            for name, value in names.items():
                patches.enter_context(mock.patch.object(module, name, value))
        run = lambda: [call(t) for t in tables]  # noqa: E731
        max_diff = (run()[0].float() - default_out.float()).abs().max().item()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        splits = A.decode_num_splits(b, kv_heads, width * block, torch.cuda.get_device_properties(0).multi_processor_count)
    us = b2b_ms(graph.replay, iters=20) * 1e3 / layers
    del graph, k, v
    return {"b": b, "context": context, "kv": kv_format, **rule, "splits": splits, "layers": layers, "us_per_layer": us,
            "bandwidth_fraction": per_layer / (us * 1e-6) / bandwidth, "max_diff_vs_default": max_diff, **compiled}


def _gluon_patches(rule: dict, compiled: dict) -> dict:
    """attention_sm90's names that {"gluon": "WxSxR"} replaces; `compiled` gets the kernel's registers, spills and
    shared memory as launched."""
    from nanoserve.kernels import attention_sm90 as G

    if not rule.get("gluon"):
        return {}
    warps, stages, regs = (int(x) for x in rule["gluon"].split("x"))
    launch = Relaunched(G._decode_kernel, compiled, **({"maxnreg": regs} if regs else {}))
    return {"WARPS": warps, "STAGES": stages, "BLOCK_N": warps * G.WARP_KEYS, "_decode_kernel": launch}


def _attention_patches(A, rule: dict) -> dict:
    """The attention module's names that one rule (attention_point) replaces."""
    patches = {"DECODE_WAVES": rule.get("waves", A.DECODE_WAVES)}
    if "stages" in rule:
        patches |= {"DECODE_NUM_STAGES": rule["stages"], "DECODE_NUM_STAGES_FP8": rule["stages"]}
    if rule.get("warps"):
        patches |= {"DECODE_NUM_WARPS": rule["warps"], "DECODE_FP8_FEW_WARPS": rule["warps"]}
    if rule.get("block_n"):
        patches |= {"_kv_tile_tokens": lambda *_, n=rule["block_n"]: n, "DECODE_FP8_FEW_BLOCK_N": rule["block_n"]}
    if rule.get("lanes"):  # an fp8 cache's CUDA-core kernel: "off", or its tile and warps as ROWSxLANESxWARPS
        if rule["lanes"] == "off":
            patches["DECODE_LANES_MAX_GROUP"] = 0
        else:
            rows, lanes, warps = (int(x) for x in rule["lanes"].split("x"))
            patches |= {"DECODE_LANES_ROWS": rows, "DECODE_LANES_ROWS_SPARSE": rows, "DECODE_LANES": lanes,
                        "DECODE_LANES_WARPS": warps, "DECODE_LANES_MAX_GROUP": 8, "DECODE_LANES_MAX_WAVES": 1 << 20}
    if rule.get("products") == "bf16":  # an fp8 cache widened to q's own dtype
        compute = A._compute_dtype
        patches["_compute_dtype"] = lambda q, cache: q.dtype if A.kv_quant.is_fp8(cache.dtype) else compute(q, cache)
    return patches


def attention_sweep(args, bandwidth: float) -> dict:
    rules = [{"waves": w, "stages": s, "warps": n, "block_n": bn, "products": pr, "lanes": la, "tail": t, "gluon": g}
             for w, s, n, bn, pr, la, t, g in itertools.product(args.waves, args.stages, args.warps, args.block_n,
                                                                args.products, args.lanes, args.tail, args.gluon)]
    out = {}
    for name in args.attention_shapes:
        shape, points = ATTENTION_SHAPES[name], out.setdefault(name, [])
        for b, context, rule, kv in itertools.product(args.attention_rows, args.attention_contexts, rules,
                                                      args.kv_formats):
            if kv == "bf16" and (rule["products"] != args.products[0] or rule["lanes"] != args.lanes[0]):
                continue  # the product dtype and the CUDA-core kernel are an fp8 cache's
            try:
                points.append(attention_point(shape, b, context, rule, bandwidth, max(args.max_model_len, context),
                                              kv))
            except Exception as exc:
                points.append({"b": b, "context": context, "kv": kv, **rule,
                               "error": f"{type(exc).__name__}: {exc}"[:300]})
            p = points[-1]
            print(f"== attention {name} {kv} b={b} ctx={context} {rule}: "
                  + (f"{p['us_per_layer']:.1f} µs/layer, {100 * p['bandwidth_fraction']:.0f}% of copy "
                     f"bandwidth, {p['splits']} splits" if "error" not in p else p["error"]), flush=True)
            release_cuda_memory()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["model", "attention", "products"])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64, 256])
    p.add_argument("--switch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--switch-sets", nargs="*", default=list(SWITCH_SETS), choices=list(SWITCH_SETS))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--gemv-rows", nargs="*", type=int, default=[], choices=sorted(set(GEMV_CANDIDATES) | set(FP8_CANDIDATES)),
                   help="rows buckets whose GEMV variants are swept in the model")
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--fp8-block", action="store_true", help="fp8 weights with 128x128-block scales")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --quantization fp8: the lm_head too")
    p.add_argument("--after-norm", action="store_true", help="products: qkv and gate_up each after its RMSNorm")
    p.add_argument("--prefill", action="store_true", help="also prompt tokens/s of 8 x 1024-token prompts")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--attention-rows", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    p.add_argument("--attention-contexts", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--waves", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--attention-shapes", nargs="+", default=list(ATTENTION_SHAPES), choices=list(ATTENTION_SHAPES))
    p.add_argument("--kv-formats", nargs="+", default=["bf16"], choices=KV_FORMATS, help="attention: cache formats")
    p.add_argument("--warps", nargs="+", type=int, default=[0], help="attention: the decode kernel's warps (0: its rule)")
    p.add_argument("--block-n", nargs="+", type=int, default=[0], help="attention: key tiles (0: the kernel's rule)")
    p.add_argument("--products", nargs="+", default=["fp16"], choices=["fp16", "bf16"],
                   help="attention: an fp8 cache's product dtype")
    p.add_argument("--lanes", nargs="+", default=[""],
                   help="attention: an fp8 cache's CUDA-core decode kernel, 'off' or ROWSxLANESxWARPS ('': the table)")
    p.add_argument("--tail", nargs="+", type=int, default=[1], choices=[0, 1],
                   help="attention: an fp8 cache read with (1, as the engine always does: its kernels then compile "
                        "to fewer registers) or without (0) the exact tail")
    p.add_argument("--gluon", nargs="+", default=[""],
                   help="attention: the Gluon fp8 decode's WARPSxSTAGESxREGISTERS (0 registers: no cap; '': as built)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.mode == "model" and args.switch_sets and max(args.switch_sizes) > max(args.batch_sizes):
        p.error(f"--switch-sizes {max(args.switch_sizes)} is more rows than the engine holds (max_num_seqs = the "
                f"largest --batch-sizes, {max(args.batch_sizes)}): pass smaller switch sizes or --switch-sets alone")
    if not torch.cuda.is_available():
        print("decode_floor.py needs a CUDA GPU")
        return 0
    bandwidth = measure_copy_bandwidth()
    report = {"env": env_info(), "settings": vars(args) | {"json": str(args.json)}, "copy_bandwidth_bytes_per_s":
              bandwidth, "models": {}}
    if args.mode in ("attention", "products"):
        report[args.mode] = (attention_sweep if args.mode == "attention" else products_sweep)(args, bandwidth)
        write_json(args.json, report) if args.json else None
        return 0
    for name in args.models:
        try:
            measure_model(name, args, bandwidth, report)
        except Exception as exc:
            report["models"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
            release_cuda_memory()
        report["summary"] = summary_rows(report)
        write_json(args.json, report) if args.json else None
    print_summary(report["summary"], args.switch_sets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
