"""Issue 34's side-by-side: the same measurements on two source trees in one device call (the commit before the
step-path rework and this one), each engine in a process of its own, the trees alternating.

Per model: `engine.step()` back to back at b running requests after 512-token prompts (decode_floor.engine_steps:
ms per step, median of 3 runs of 30 steps), and for Qwen3-0.6B one 4000-token prompt's wall time through
`LLM.generate(max_tokens=1)` (an eager prompt step: over the largest token-count graph), median of REPEATS fresh
prompts after a warm-up. Random bf16 weights, real shapes, max_model_len 4096.

    python benchmarks/step_path.py --trees old=.old/src new=src [--models qwen3-0.6b llama-3.1-8b] [--rounds 2]
                                   [--batch-sizes 1 64 256] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_info, write_json, write_model_dir  # noqa: E402

REPEATS = 15
PROMPT_TOKENS = 4000


def measure(model: str, batch_sizes: list[int], prompt: bool, max_model_len: int = 4096) -> dict:
    import torch

    from benchmarks.decode_floor import engine_steps
    from nanoserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        llm = LLM(str(write_model_dir(model, tmp)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=max_model_len, max_num_seqs=max(batch_sizes), show_progress=False)
        rec = {"start_up_s": time.perf_counter() - start, "steps": {}}
    for b in batch_sizes:
        r = engine_steps(llm, b, min(512, max_model_len // 2))
        rec["steps"][str(b)] = {k: r[k] for k in ("step_ms", "step_samples_ms", "rows_seen", "step_context")}
    if prompt:
        gen, params = torch.Generator().manual_seed(0), SamplingParams(max_tokens=1, temperature=0.0)
        samples = []
        for i in range(REPEATS + 1):
            ids = torch.randint(0, 10000, (PROMPT_TOKENS,), generator=gen).tolist()
            t = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            if i:
                samples.append((time.perf_counter() - t) * 1e3)
        rec["prompt_4000_ms"] = {"median": statistics.median(samples), "min": min(samples), "samples": samples}
    llm.close()
    return rec


def _run(tree: str, model: str, batch_sizes: list[int], prompt: bool, max_model_len: int) -> dict:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / tree), str(root), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--one", model, "--batch-sizes", *map(str, batch_sizes),
           "--max-model-len", str(max_model_len)] + (["--prompt"] * prompt)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{tree} {model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", default=["new=src"], help="NAME=SRC_DIR (the package's parent folder)")
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--prompt", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.batch_sizes, args.prompt, args.max_model_len)))
        return 0
    trees = dict(t.split("=", 1) for t in args.trees)
    report = {"env": env_info(), "command": " ".join(sys.argv), "trees": trees, "runs": []}
    for model in args.models:
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                rec = _run(tree, model, args.batch_sizes, model.startswith("qwen3"), args.max_model_len)
                report["runs"].append({"model": model, "tree": name, "round": round_, **rec})
                steps = ", ".join(f"b={b}: {r['step_ms']:.3f}" for b, r in rec["steps"].items())
                extra = f"; 4000-token prompt {rec['prompt_4000_ms']['median']:.2f} ms (min " \
                        f"{rec['prompt_4000_ms']['min']:.2f})" if "prompt_4000_ms" in rec else ""
                print(f"{model:13s} {name:4s} round {round_}: step ms {steps}{extra}", flush=True)
                if args.json:
                    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
