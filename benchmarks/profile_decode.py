"""Where a decode step's GPU time goes: per-kernel time of one eager decode forward (torch.profiler),
next to the graph replay time of the same step. The gap between the kernel sum and the replay time
is what launch gaps still cost inside the graph.

    python benchmarks/profile_decode.py [--models qwen3-0.6b llama-3.1-8b] [--batch-sizes 1 64] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.common import env_info, model_config, release_cuda_memory, time_ms, write_json, write_model_dir  # noqa: E402
from nanoserve import LLM  # noqa: E402


def kernel_table(runner, batch) -> tuple[list[tuple[str, int, float]], float]:
    """(name, calls, total µs) per kernel of one eager forward, and the summed kernel time in µs."""
    for _ in range(3):
        runner.decode_logits(batch, use_graph=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode_logits(batch, use_graph=False)
        torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name][0] += 1
            totals[evt.name][1] += evt.device_time
    rows = sorted(((n[:90], c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def host_profile(llm, batch_size: int, context: int, steps: int = 10) -> None:
    """cProfile of engine.step() for a full decode batch: what the host adds around the replay."""
    import cProfile
    import pstats

    from nanoserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 5, ignore_eos=True, temperature=0.0)
    for i in range(batch_size):
        engine.add_request(f"host-{i}", [7] * context, params)
    while engine.stats.num_waiting:
        engine.step()
    engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n== host profile: {steps} engine.step() at b={batch_size}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    for i in range(batch_size):
        engine.abort_request(f"host-{i}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--host-profile", action="store_true", help="also cProfile engine.step() at the largest batch")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_decode.py needs a CUDA GPU")
        return 0
    report = {"env": env_info(), "command": " ".join(sys.argv), "models": {}}
    for name in args.models:
        cfg = model_config(name)
        with tempfile.TemporaryDirectory() as tmp:
            llm = LLM(str(write_model_dir(cfg, tmp)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      max_num_seqs=max(args.batch_sizes), max_model_len=1024,
                      num_kv_blocks=max(args.batch_sizes) * (args.context // 16 + 1) + 64, show_progress=False)
            runner = llm.engine.model_runner
            for b in args.batch_sizes:
                batch = runner.dummy_decode_batch(b, args.context)
                rows, kernel_us = kernel_table(runner, batch)
                replay_ms = sorted(time_ms(partial(runner.decode_logits, batch), "cuda", warmup=5, iters=50))[25]
                calls = sum(r[1] for r in rows)
                print(f"\n== {name} b={b}: {calls} kernels, kernel sum {kernel_us / 1000:.3f} ms, "
                      f"graph replay {replay_ms:.3f} ms")
                for n, c, t in rows[:14]:
                    print(f"  {t:9.1f} µs {c:5d}×  {n}")
                report["models"][f"{name}/b{b}"] = {"kernels": calls, "kernel_sum_ms": kernel_us / 1000,
                                                   "replay_ms": replay_ms, "top": rows[:25]}
            if args.host_profile:
                host_profile(llm, max(args.batch_sizes), args.context)
            del llm, runner
            release_cuda_memory()
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
