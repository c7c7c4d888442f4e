"""What the host does per step: wall time vs device time and a cProfile of engine.step(), for one
prefill step (a prompt of --prompt-len tokens) and for decode steps at the given batch sizes.

    python benchmarks/profile_host.py [--model qwen3-0.6b] [--batch-sizes 1 256] [--out FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_info, model_config, write_model_dir  # noqa: E402


def profiled(fn, top: int = 18) -> tuple[float, str]:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t = time.perf_counter()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    seconds = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return seconds, text.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 256])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_host.py needs a CUDA GPU")
        return 0
    from nanoserve import LLM, SamplingParams

    lines = [str(env_info())]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(write_model_dir(model_config(args.model), tmp)), load_format="dummy", skip_tokenizer_init=True,
                  max_num_seqs=max(args.batch_sizes), max_model_len=4096, show_progress=False)
        engine = llm.engine
        for i in range(3):  # warm-up: compile every kernel of both paths
            llm.generate([[7 + i] * args.prompt_len], SamplingParams(max_tokens=4), use_tqdm=False)
        engine.add_request("p", [11] * args.prompt_len, SamplingParams(max_tokens=1))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        seconds, text = profiled(lambda: [engine.step() for _ in range(2)])
        end.record()
        end.synchronize()
        lines.append(f"== prefill of {args.prompt_len} tokens (+ drain): wall {seconds * 1e3:.2f} ms, "
                     f"device {start.elapsed_time(end):.2f} ms\n{text}")
        for b in args.batch_sizes:
            params = SamplingParams(max_tokens=args.steps + 20, temperature=0.0, ignore_eos=True)
            for i in range(b):
                engine.add_request(f"d{b}-{i}", [3 + i % 1000] * 64, params)
            while engine.core.scheduler.waiting or not all(s.decoding for s in engine.core.scheduler.running):
                engine.step()
            for _ in range(5):
                engine.step()
            seconds, text = profiled(lambda: [engine.step() for _ in range(args.steps)])
            lines.append(f"== decode b={b}: {args.steps} steps, {seconds / args.steps * 1e3:.3f} ms per step\n{text}")
            for i in range(b):
                engine.abort_request(f"d{b}-{i}")
            while engine.has_unfinished_requests():
                engine.step()
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
