"""What structured outputs cost: decode tok/s and ms per step, constrained vs unconstrained, at b = 1 and b = 64, and
grammar compile times (issue 18's target: a constrained decode step <= 1.10x an unconstrained one).

The model is a real shape with random weights (load_format="dummy", Qwen3-0.6B by default). The tokenizer is a real
one when --tokenizer names a folder (a model's own, e.g. Qwen3's), else a synthetic byte-level BPE vocabulary as
wide as the model's (256 bytes + pieces of words, numbers, JSON punctuation; deterministic), so xgrammar's masks
cover a realistic number of tokens. Prompts are random token ids (ignore_eos: every row decodes max_tokens).

Modes, each on b rows of the same prompt length:
  * free        - unconstrained, async loop on (the default engine);
  * constrained - every row under a JSON schema (an array of >= 200 {name, age, tags} objects: it cannot end within
                  max_tokens, so the batch keeps its size), async loop on: each step's forward is launched at once,
                  the next step is scheduled and built, then the step before is read, the masks filled and the
                  sampler launched, then the next forward (engine/grammar.py);
  * free_sync   - unconstrained with async_scheduling=False: what losing the overlap altogether would cost.
"decode" holds per b the median run of each mode and constrained_over_free (the issue's ratio, target <= 1.10).
The breakdown (on unless --no-breakdown) adds one run per mode and b with the loop's phases timed (PHASES:
schedule, build, read with its wait on the device, mask fill, the two launches, the front end; ms per step) and,
on CUDA, a short run under torch.profiler giving the GPU's busy time per step: busy well under the wall time per
step means the device idles, and the phases say for what.
Compile: the tokenizer info once, then the benchmark schema, JSON mode and a regex (cold), and the mask fill of one
row (xgrammar's fill_next_token_bitmask) inside a JSON string and between properties.

Writes $OUT/structured_overhead.json (or --out). On the GPU (the lead; the image lacks xgrammar, apache-tvm-ffi,
msgspec and pydantic: they are in benchmarks/serve_gpu_wheels.txt, whose header says how to fetch the wheels):
    pip install -q --no-index --no-deps --find-links wheels -r benchmarks/serve_gpu_wheels.txt
    python benchmarks/structured_overhead.py --out $OUT/structured_overhead.json
CPU smoke check (tiny shape, seconds):
    python benchmarks/structured_overhead.py --model tiny --device cpu --batch-sizes 1 4 --max-tokens 16 \
        --out /tmp/so.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: benchmarks.common

from benchmarks.common import env_info, model_config, release_cuda_memory, write_json, write_model_dir  # noqa: E402

TINY = dict(model_config("qwen3-0.6b"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=8192, eos_token_id=2, bos_token_id=1)
SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 3}}}}
PIECES = ['{"', '":', '",', '"}', '[{', '}]', ', "', '": "', "true", "false", "null", "\\n", "\\u"]


def synthetic_tokenizer(vocab_size: int, eos_id: int, directory: Path) -> Path:
    """A byte-level BPE tokenizer of vocab_size tokens (byte tokens first, the EOS at eos_id), saved as a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    rng, letters = random.Random(0), "etaoinshrdlucmfwypvbgkjqxz"
    vocab: dict[str, int] = {c: i for i, c in enumerate(byte_char.values())}
    words = [p for p in PIECES] + [str(n) for n in range(1000)]
    while len(vocab) + len(words) < vocab_size * 2:
        words.append("".join(rng.choices(letters, weights=range(26, 0, -1), k=rng.randint(2, 10))))
    space = byte_char[ord(" ")]
    for w in words:
        if len(vocab) >= vocab_size - 1:
            break
        encoded = "".join(byte_char[b] for b in w.encode())
        for piece in (encoded, space + encoded):
            if piece not in vocab and len(vocab) < vocab_size - 1:
                vocab[piece] = len(vocab)
    ids = {piece: (i if i < eos_id else i + 1) for piece, i in vocab.items()}  # leave eos_id free
    ids["<|endoftext|>"] = eos_id
    tok = Tokenizer(models.BPE(ids, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="structured outputs' decode overhead and compile times; writes JSON")
    p.add_argument("--model", default="qwen3-0.6b", help="a shape of benchmarks/common.py, or 'tiny' (CPU check)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: a synthetic one)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256, help="decode steps per timed run")
    p.add_argument("--runs", type=int, default=3, help="timed runs per mode and batch size (median reported)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the extra run per mode and batch size that times the loop's phases (and, on CUDA, "
                        "the device's busy time under torch.profiler)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "structured_overhead.json"))
    return p.parse_args(argv)


def make_llm(model_dir: Path, tokenizer: Path, args, async_scheduling: bool):
    from nanoserve import LLM

    return LLM(str(model_dir), tokenizer=str(tokenizer), load_format="dummy", device=args.device, dtype=args.dtype,
               max_num_seqs=max(args.batch_sizes), max_model_len=args.prompt_len + args.max_tokens + 16,
               cudagraph_capture_sizes=sorted(set(args.batch_sizes)), prefill_graph_sizes="off",
               async_scheduling=async_scheduling, show_progress=False)


def timed_run(llm, b: int, args, constrained: bool) -> dict:
    """One generate of b rows: wall seconds, tokens, steps (stats deltas), ms per step and tok/s."""
    from nanoserve import SamplingParams

    rng = random.Random(b)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(1000, vocab - 1) for _ in range(args.prompt_len)] for _ in range(b)]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,  # unseeded: no per-row RNG
                            structured_outputs={"json": SCHEMA} if constrained else None)
    before = llm.engine.stats
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.engine.stats
    steps = sum(getattr(after, k) - getattr(before, k) for k in ("decode_steps_graph", "decode_steps_eager",
                                                                "mixed_steps"))
    tokens = sum(len(o.token_ids) for o in outs)
    if constrained:  # the constraint held (and nothing ended early)
        assert all(o.finish_reason == "length" and o.text.startswith("[") for o in outs), outs[0].text[:200]
    return {"wall_s": wall, "tokens": tokens, "steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
            "tok_per_s": tokens / wall}


def measure_modes(model_dir: Path, tokenizer: Path, args) -> dict:
    results: dict = {}
    for mode, async_scheduling in (("free", True), ("constrained", True), ("free_sync", False)):
        llm = make_llm(model_dir, tokenizer, args, async_scheduling)
        for b in args.batch_sizes:
            results.setdefault(f"b{b}", {})[mode] = best = measure_one(llm, b, args, mode == "constrained")
            print(f"b={b:3d} {mode:12s} {best['ms_per_step']:8.3f} ms/step {best['tok_per_s']:10.1f} tok/s "
                  f"{best.get('phases_ms_per_step', '')} busy {best.get('device_busy_ms_per_step', '-')}", flush=True)
        llm.close()
        del llm
        release_cuda_memory()
    for row in results.values():
        row["constrained_over_free"] = row["constrained"]["ms_per_step"] / row["free"]["ms_per_step"]
        row["sync_over_free"] = row["free_sync"]["ms_per_step"] / row["free"]["ms_per_step"]
    return results


def measure_one(llm, b: int, args, constrained: bool) -> dict:
    """The median of the timed runs; with the breakdown, one more run's phase times and the device's busy time."""
    timed_run(llm, b, args, constrained)  # warm-up: compile, kernels, allocator
    runs = [timed_run(llm, b, args, constrained) for _ in range(args.runs)]
    best = dict(sorted(runs, key=lambda r: r["ms_per_step"])[len(runs) // 2],
                runs_ms_per_step=[r["ms_per_step"] for r in runs])
    if args.breakdown:
        with timed_phases() as seconds:
            run = timed_run(llm, b, args, constrained)
        best["phases_ms_per_step"] = {k: round(1e3 * v / run["steps"], 4) for k, v in seconds.items()}
        best["phases_run_ms_per_step"] = run["ms_per_step"]
        if llm.engine.core.runner.device.type == "cuda":
            best["device_busy_ms_per_step"] = device_busy(llm, b, args, constrained)
    return best


# The loop's phases, each a function wrapped by a timer for one run. Nested: "read" (EngineCore._read) includes
# "wait" (a SampleHandle's result: the host blocked on the device, then the copy's unpacking) and the matchers'
# accept; "mask" is the host's part of the mask fill (Grammars.start_fill: all of it below a few rows, else the
# hand-off to the fill thread), "mask_wait" the wait for that thread after scheduling and building; "inputs" (the
# decode inputs' host fill and copy) and "replay" (every graph replay: decode and sampler) fall within the launches;
# the rest are disjoint.
PHASES = [("schedule", "nanoserve.engine.scheduler", "Scheduler", "schedule"),
          ("build", "nanoserve.engine.core", None, "build_batch"),
          ("read", "nanoserve.engine.core", "EngineCore", "_read"),
          ("wait", "nanoserve.runner.sampler", "SampleHandle", "result"),
          ("complete", "nanoserve.engine.core", "EngineCore", "_complete"),
          ("mask", "nanoserve.engine.grammar", "Grammars", "start_fill"),
          ("mask_wait", "nanoserve.engine.grammar", "MaskFill", "result"),
          ("launch_forward", "nanoserve.runner.model_runner", "ModelRunner", "execute"),
          ("inputs", "nanoserve.runner.inputs", "DecodeInputs", "load"),  # (via DecodeForward.load)
          ("replay", "nanoserve.runner.cuda_graph", "GraphRunner", "replay"),
          ("launch_sampler", "nanoserve.runner.model_runner", "ModelRunner", "sample_deferred"),
          ("front_end", "nanoserve.engine.output", "OutputProcessor", "process")]


@contextmanager
def timed_phases():
    """Seconds spent in each of PHASES while the block runs (the functions are put back after it)."""
    seconds = dict.fromkeys((name for name, *_ in PHASES), 0.0)
    saved = []
    for name, module, cls, attr in PHASES:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        fn = owner.__dict__[attr] if cls else getattr(owner, attr)

        def timed(*a, _fn=fn, _name=name, **k):
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[_name] += time.perf_counter() - start

        saved.append((owner, attr, fn))
        setattr(owner, attr, timed)
    try:
        yield seconds
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def device_busy(llm, b: int, args, constrained: bool, steps: int = 64) -> dict | str:
    """A short run under torch.profiler: the time per step with any kernel or copy running on the GPU (merged
    intervals) against that run's wall time per step (the profiler's own host cost included)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run = timed_run(llm, b, argparse.Namespace(**dict(vars(args), max_tokens=steps)), constrained)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
    except Exception as e:  # a diagnostic: never lose the run for it
        return f"not measured: {type(e).__name__}: {e}"
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"busy_ms_per_step": busy / 1e3 / run["steps"], "wall_ms_per_step": run["ms_per_step"]}


def measure_compile(tokenizer_dir: Path, vocab_size: int, eos_ids: list[int]) -> dict:
    """Tokenizer info, cold and cached compiles of three constraints, and the mask fill per row."""
    import xgrammar as xgr

    from nanoserve.engine.grammar import grammar_of
    from nanoserve.model_files import load_tokenizer
    from nanoserve.sampling import StructuredOutputsParams as S

    out = {}
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(tokenizer_dir), vocab_size=vocab_size,
                                              stop_token_ids=eos_ids)
    out["tokenizer_info_s"] = time.perf_counter() - start
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled = {}
    for name, so in (("schema", S(json=SCHEMA)), ("json_object", S(json_object=True)),
                     ("regex", S(regex=r"[0-9]{3}-[0-9]{4} [A-Za-z ]{1,40}"))):
        start = time.perf_counter()
        compiled[name] = compiler.compile_grammar(grammar_of(so))
        out[f"compile_{name}_s"] = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled["schema"])
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    assert matcher.accept_string('[{"name": "ab')
    out["fill_us_in_string"] = _fill_us(matcher, bitmask)
    assert matcher.accept_string('c", ')
    out["fill_us_between_properties"] = _fill_us(matcher, bitmask)
    return out


def _fill_us(matcher, bitmask, iters: int = 200) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = TINY if args.model == "tiny" else model_config(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(cfg, Path(tmp) / "model")
        eos = cfg["eos_token_id"]
        tokenizer = Path(args.tokenizer) if args.tokenizer else synthetic_tokenizer(cfg["vocab_size"], eos,
                                                                                    Path(tmp) / "tokenizer")
        modes = measure_modes(model_dir, tokenizer, args)
        compile_times = measure_compile(tokenizer, cfg["vocab_size"], [eos])
        print(json.dumps(compile_times), flush=True)
    result = {"env": env_info(), "settings": vars(args), "model_config": cfg, "compile": compile_times,
              "decode": modes}
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
