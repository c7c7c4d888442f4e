"""nanoserve demo: CUDA-graph decode, captured once and replayed every step.

    python run.py                      # on a GPU: Qwen3-0.6B shape, random bf16 weights
    python run.py --model DIR          # a local Hugging Face folder (safetensors) instead
    python run.py --cpu                # the CPU demo even when a GPU is present

On a GPU the engine captures one decode graph per batch-size bucket (1, 2, 4, … max_num_seqs) at
start-up. This script then prints, per bucket, eager vs copy + replay ms per decode step and the
padding a graph costs, and checks that greedy tokens with graphs equal an enforce_eager engine's.
Without a GPU it says so and runs a tiny random model eagerly on the CPU instead.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (DTYPE_BYTES, kv_blocks_needed, kv_bytes_per_token, padding_rows, param_counts,
                               write_model_dir)
from nanoserve.bench.common import release_memory as release_cuda_memory
from nanoserve.bench.decode_step import decode_batch, time_decode_step
from nanoserve.runner.dispatch import Kind

DEFAULT_MODEL = "qwen3-0.6b"
GEN_PROMPT_LENS = [5, 17, 33, 64, 100, 250]  # 6 sequences → decode batch 6 → bucket 8 with 2 padding rows
GEN_TOKENS = 32
NEAR_TIE = {"bfloat16": 0.1, "float16": 0.02, "float32": 1e-3}  # logprob gap below which rounding can flip argmax


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", help="local HF model folder (default: Qwen3-0.6B shape with random weights)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="model dtype on the GPU")
    p.add_argument("--max-num-seqs", type=int, default=256, help="largest decode batch = largest graph bucket")
    p.add_argument("--context", type=int, default=512, help="KV tokens per row in the timing table")
    p.add_argument("--iters", type=int, default=20, help="timed decode steps per table cell (median)")
    p.add_argument("--no-fp32-check", action="store_true", help="skip the float32 graph-vs-eager token check")
    p.add_argument("--cpu", action="store_true", help="run the CPU demo even if a GPU is present")
    args = p.parse_args(argv)
    for name in ("max_num_seqs", "context", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# CPU: explain, then show the engine working eagerly on a tiny model


def cpu_demo() -> int:
    from nanoserve import LLM, SamplingParams
    from nanoserve.tiny import make_tiny_model

    print("run.py: no CUDA GPU here, so there are no CUDA graphs to capture or replay.")
    print("On a GPU it builds a Qwen3-0.6B-shaped model (random bf16 weights), captures one decode graph per "
          "batch-size bucket (1, 2, 4, … 256), prints per bucket eager vs graph replay ms per decode step, the "
          "speed-up and the padding rows, and checks greedy tokens with graphs == enforce_eager tokens.")
    print("Meanwhile, the same engine running eagerly on the CPU with a tiny random Qwen3 model:\n")
    with tempfile.TemporaryDirectory(prefix="nanoserve-tiny-") as tmp:
        t0 = time.perf_counter()
        make_tiny_model(tmp, arch="qwen3", seed=0)
        llm = LLM(tmp, device="cpu", max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
        startup = time.perf_counter() - t0
        prompts: list = ["Hello, world!", "The capital of France is", [5, 6, 7, 8, 9]]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        for prompt, out in zip(prompts, outputs):
            shown = repr(prompt) if isinstance(prompt, str) else f"token ids {prompt}"
            print(f"  {shown}\n    → {out.token_ids}\n    → {out.text!r}")
        stats = llm.engine.stats
        generated = sum(len(o.token_ids) for o in outputs)
        print(f"\nstart-up {startup:.1f} s; {generated} tokens in {seconds:.2f} s ({generated / seconds:.0f} tok/s); "
              f"decode steps: {stats.decode_steps_eager} eager, {stats.decode_steps_graph} on graphs "
              f"(graphs need CUDA); KV blocks {stats.kv_blocks_total}, in use after finishing {stats.kv_blocks_used}")
    return 0


# ---------------------------------------------------------------------------------------------
# GPU: capture, time every bucket, compare tokens with and without graphs


def gpu_demo(args: argparse.Namespace) -> int:
    from nanoserve import LLM

    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nanoserve-run-") as tmp:
        if args.model:
            model_dir, load_format = Path(args.model), "auto"
            label = str(model_dir)
        else:
            model_dir, load_format = write_model_dir(DEFAULT_MODEL, tmp), "dummy"
            label = f"{DEFAULT_MODEL} shape, random weights"
        cfg = json.loads((model_dir / "config.json").read_text())
        dtype_bytes = DTYPE_BYTES[args.dtype]
        gen_tokens_per_seq = max(GEN_PROMPT_LENS) + GEN_TOKENS + 1
        tokens_per_seq = max(args.context, gen_tokens_per_seq)
        max_model_len = min(max(1024, math.ceil(tokens_per_seq / 16) * 16), int(cfg["max_position_embeddings"]))
        if tokens_per_seq > max_model_len:
            print(f"--context {args.context} exceeds the model's max_position_embeddings {max_model_len}")
            return 2
        max_num_seqs = _fit_max_num_seqs(cfg, args.max_num_seqs, tokens_per_seq, dtype_bytes)
        options = dict(load_format=load_format, skip_tokenizer_init=True, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                       cudagraph_capture_sizes="pow2")  # the design notes' buckets ("auto" plans its own)
        blocks = max(kv_blocks_needed(max_num_seqs, tokens_per_seq, 16), math.ceil(max_model_len / 16))

        print(f"building {label} ({args.dtype}, max_num_seqs {max_num_seqs}) and capturing its decode graphs …")
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), dtype=args.dtype, num_kv_blocks=blocks, **options)
        startup = time.perf_counter() - t0
        runner = llm.engine.core.runner
        gr = runner.graphs.runners.get(Kind.DECODE)
        if gr is None:
            print("this engine captured no graphs (enforce_eager?) — nothing to demonstrate")
            return 1
        kv_gib = llm.engine.stats.kv_blocks_total * runner.info.kv_block_bytes / 2**30
        print(f"\ncapture: {len(gr.capture_sizes)} graphs (batch sizes {gr.capture_sizes}) in "
              f"{gr.capture_seconds:.2f} s; "
              f"graph pool {gr.pool_bytes / 2**20:.1f} MiB; KV cache {llm.engine.stats.kv_blocks_total} blocks × 16 "
              f"tokens ({kv_gib:.2f} GiB); start-up {startup:.1f} s in all")

        failures += timing_table(runner, LLM(str(model_dir), dtype=args.dtype, num_kv_blocks=blocks,
                                             enforce_eager=True, **_without_sizes(options)), args)
        print()
        try:
            failures += generation_check(llm, LLM, model_dir, cfg, args.dtype, options, max_model_len)
        except Exception:
            traceback.print_exc()
            failures.append(f"{args.dtype} generation check crashed")
        gr = runner = llm = None  # noqa: F841 — release the bf16 engine before the fp32 pair
        release_cuda_memory()

        if args.dtype != "float32" and not args.no_fp32_check:
            print()
            if _fits(cfg, copies=2, tokens=len(GEN_PROMPT_LENS) * gen_tokens_per_seq, dtype_bytes=4):
                try:
                    fp32 = dict(options, max_num_seqs=8, cudagraph_capture_sizes=[1, 2, 4, 8])
                    failures += generation_check(None, LLM, model_dir, cfg, "float32", fp32, max_model_len)
                except Exception:
                    traceback.print_exc()
                    failures.append("float32 generation check crashed")
            else:
                print("float32 check skipped: two float32 copies of this model do not fit in free GPU memory")

    print()
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    print("all checks passed")
    return 0


def _fit_max_num_seqs(cfg: dict, wanted: int, tokens_per_seq: int, dtype_bytes: int) -> int:
    """Largest max_num_seqs ≤ wanted whose KV and weights fit twice in free memory (graph and eager engine)."""
    free, _ = torch.cuda.mem_get_info()
    weights = param_counts(cfg).total * dtype_bytes
    n = wanted
    while n > 1 and weights + n * tokens_per_seq * kv_bytes_per_token(cfg, dtype_bytes) > 0.4 * free:
        n //= 2
    if n != wanted:
        print(f"(free GPU memory {free / 2**30:.1f} GiB: using max_num_seqs {n} instead of {wanted})")
    return n


def _fits(cfg: dict, copies: int, tokens: int, dtype_bytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    need = copies * (param_counts(cfg).total * dtype_bytes + 2 * tokens * kv_bytes_per_token(cfg, dtype_bytes))
    return need < 0.8 * free


def _without_sizes(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != "cudagraph_capture_sizes"}


def timing_table(runner, eager_llm, args: argparse.Namespace) -> list[str]:
    """bucket_table against an enforce_eager engine of the same shape, released afterwards."""
    try:
        return bucket_table(runner, eager_llm.engine.core.runner, list(runner.info.decode_graph_sizes), args)
    finally:
        eager_llm = None  # noqa: F841
        release_cuda_memory()


def bucket_table(runner, eager_runner, buckets: list[int], args: argparse.Namespace) -> list[str]:
    """Per bucket B: the eager engine's forward vs the graph engine's replay at b = B, and the padding of the
    worst case b = previous bucket + 1 (whose tokens the generation check below compares with eager's)."""
    print(f"\ndecode step = forward + logits of b rows, each with {args.context} tokens of KV (nanoserve.bench."
          f"decode_step); CUDA-event timed after a synchronize, median of {args.iters} after warm-up. 'replay' "
          "includes copying the inputs into the static buffers.")
    print(f"{'bucket':>6} {'eager ms':>9} {'replay ms':>10} {'speed-up':>9} │ {'b=prev+1':>8} {'pad rows':>8} "
          f"{'waste':>6}")
    failures, prev = [], 0
    for bucket in buckets:
        try:
            eager = statistics.median(time_decode_step(eager_runner, decode_batch(eager_runner, bucket, args.context),
                                                       3, args.iters))
            replay = statistics.median(time_decode_step(runner, decode_batch(runner, bucket, args.context), 3,
                                                        args.iters))
            b = prev + 1
            pad = padding_rows(b, buckets)
            print(f"{bucket:>6} {eager:9.3f} {replay:10.3f} {eager / replay:8.1f}x │ {b:>8} {pad:>8} "
                  f"{pad / bucket:6.0%}", flush=True)
        except Exception as error:
            traceback.print_exc()
            print(f"{bucket:>6} error: {type(error).__name__}: {error}")
            failures.append(f"bucket {bucket} failed")
        prev = bucket
    print("padding: b rows replay the smallest bucket ≥ b; rows b..bucket-1 read/write only the reserved dummy KV "
          "block. Worst case b = previous bucket + 1 wastes almost half the rows, but decode is bound by reading "
          "the weights, which every row shares, so the step barely gets slower.")
    return failures


def generation_check(llm, llm_cls, model_dir: Path, cfg: dict, dtype: str, options: dict,
                     max_model_len: int) -> list[str]:
    """Greedy tokens with graphs vs an enforce_eager engine on the same weights.

    Why two dtypes: in bf16 the graph runs the bucket's 8 rows where eager runs 6, so GEMMs may pick
    other kernels and logits differ by bf16 rounding (~1e-2); greedy picks can then flip where two
    logits nearly tie (common with random weights), and the sequences part. Each divergence is
    checked: the eager engine's logprob gap between the two tokens must be below a rounding-sized
    threshold. In float32 rounding is ~1e-6, so tokens must match: that is the strict check.
    """
    from nanoserve import SamplingParams

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist() for n in GEN_PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True, logprobs=5)
    blocks = max(kv_blocks_needed(len(prompts), max(GEN_PROMPT_LENS) + GEN_TOKENS + 1, 16),
                 math.ceil(max_model_len / 16))
    own = llm is None
    graph_llm = llm_cls(str(model_dir), dtype=dtype, num_kv_blocks=blocks, **options) if own else llm
    eager_llm = llm_cls(str(model_dir), dtype=dtype, num_kv_blocks=blocks, enforce_eager=True,
                        **_without_sizes(options))
    copied = _copy_weights(graph_llm, eager_llm)
    before = graph_llm.engine.stats
    graph_out = graph_llm.generate(prompts, params, use_tqdm=False)
    after = graph_llm.engine.stats
    eager_out = eager_llm.generate(prompts, params, use_tqdm=False)
    eager_llm = graph_llm = None  # noqa: F841
    release_cuda_memory()

    steps = after.decode_steps_graph - before.decode_steps_graph
    pads = after.padding_rows - before.padding_rows
    print(f"{dtype} greedy generation, {len(prompts)} token-id prompts × {GEN_TOKENS} tokens "
          f"({'weights copied from the graph engine' if copied else 'weights: same seeded dummy init'}): "
          f"{steps} decode steps on graphs, {pads} padding rows in all")
    same, divergences = compare_tokens(graph_out, eager_out, NEAR_TIE[dtype])
    failures = []
    for d in divergences:
        gap_text = (f"eager logprob gap {d.gap:.4f}" if d.gap is not None else "graph token not in eager's top 5")
        verdict = f"a near-tie (< {d.tol}): rounding, not a bug" if d.near_tie else "NOT a near-tie"
        print(f"  sequence {d.index}: first differs at token {d.position}: eager {d.eager_token}, graph "
              f"{d.graph_token}; {gap_text} → {verdict}")
        if not d.near_tie:
            failures.append(f"{dtype}: sequence {d.index} diverges at token {d.position} without a near-tie")
    print(f"{dtype}: {same}/{len(prompts)} sequences identical to enforce_eager")
    if dtype == "float32":
        print("  (float32 rounding is ~1e-6: graph and eager tokens must be identical — the strict check)")
    else:
        print(f"  ({dtype}: the graph runs its bucket's rows, eager only the real ones, so GEMMs may pick other "
              "kernels; logits then differ by rounding and a greedy pick can flip at a near-tie, after which the "
              "sequences part. A divergence counts as a failure only when it was not a near-tie.)")
    if steps == 0:
        failures.append(f"{dtype}: no decode step used a graph")
    return failures


@dataclass
class Divergence:
    index: int  # which sequence
    position: int  # first output token that differs
    eager_token: int
    graph_token: int
    gap: float | None  # eager logprob(eager token) - logprob(graph token); None if not in eager's top-N
    tol: float

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and self.gap <= self.tol


def compare_tokens(graph_out, eager_out, tol: float) -> tuple[int, list[Divergence]]:
    """Count identical completions; for each other, where it first parts and whether that was a
    near-tie in the eager run (both runs saw the same tokens up to there, so the gap is comparable)."""
    same, divergences = 0, []
    for i, (g, e) in enumerate(zip(graph_out, eager_out)):
        if g.token_ids == e.token_ids:
            same += 1
            continue
        pairs = list(zip(g.token_ids, e.token_ids))
        k = next((j for j, (a, b) in enumerate(pairs) if a != b), len(pairs))
        if k == len(pairs):  # one is a prefix of the other: a length difference, never a tie
            divergences.append(Divergence(i, k, -1, -1, None, tol))
            continue
        lp = e.logprobs[k] if e.logprobs and k < len(e.logprobs) else {}
        gap = lp[e.token_ids[k]] - lp[g.token_ids[k]] if g.token_ids[k] in lp and e.token_ids[k] in lp else None
        divergences.append(Divergence(i, k, e.token_ids[k], g.token_ids[k], gap, tol))
    return same, divergences


def _copy_weights(src_llm, dst_llm) -> bool:
    """Make the eager engine's weights bit-identical to the graph engine's (in place: graphs keep their addresses)."""
    try:
        src, dst = src_llm.engine.core.runner.model, dst_llm.engine.core.runner.model
        with torch.inference_mode():
            dst.load_state_dict(src.state_dict(), strict=True)
        return True
    except Exception as error:
        print(f"(could not copy weights between engines: {type(error).__name__}: {error})")
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.cpu or not torch.cuda.is_available():
        return cpu_demo()
    return gpu_demo(args)


if __name__ == "__main__":
    sys.exit(main())
