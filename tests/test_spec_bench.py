"""benchmarks/speculative.py (issue 38's offline benchmark) on a tiny random model with two short prompts: the JSON's
fields, greedy outputs identical across methods, the method settings and overrides; and the committed workloads'
shape; benchmarks/speculative_serve.py through real `nanoserve serve` processes; benchmarks/spec_host.py's report;
benchmarks/speculative_ties.py pricing a first difference. The real SmolLM2 run is
`python benchmarks/speculative.py workload --device cpu --limit N`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import spec_host, spec_workloads, speculative, speculative_serve, speculative_ties  # noqa: E402

PROMPTS = [{"source": "test", "messages": [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat."}]},
           {"source": "test", "messages": [{"role": "user", "content": "Tell me a story."}]}]
RECORD_FIELDS = {"prompts", "prompt_tokens", "output_tokens", "seconds", "output_tok_s", "per_prompt", "stats",
                 "speculation", "first_output_text", "mismatches", "identical_to_none", "tok_s_vs_none", "loop"}
SPECULATION_FIELDS = {"method", "num_drafts", "draft_tokens", "accepted_tokens", "acceptance_rate",
                      "mean_accepted_length", "accepted_per_position"}


def test_workload_files_have_sixteen_sourced_prompts():
    for name in speculative.WORKLOADS:
        prompts = speculative.load_workload(name)
        assert len(prompts) == 16 and all(p["source"] and p["messages"][0]["role"] == "user" for p in prompts)
        assert len(speculative.load_workload(name, limit=3)) == 3
    lo, hi = spec_workloads.PASSAGE_TOKENS
    assert all(lo <= p["passage_tokens"] <= hi for p in speculative.load_workload("copy"))
    with pytest.raises(ValueError, match="unknown workload"):
        speculative.load_workload("nope")


def test_workload_edits_are_seeded():
    text = "Exceptions are raised whenever something happens that the interpreter cannot handle " * 4
    typos = spec_workloads.add_typos(text, rate=0.5)
    assert typos == spec_workloads.add_typos(text, rate=0.5) != text and len(typos) == len(text)
    assert spec_workloads.apply_edit("a = b\n", ("replace", "b", "c")) == "a = c\n"
    assert spec_workloads.cut("one\ntwo\nthree\n", len, 8) == "one\ntwo\n"


def test_method_configs_merge_overrides_and_check_them():
    configs = speculative.method_configs(["none", "ngram", "ngram8", "suffix"],
                                         ['ngram8={"method": "ngram", "num_speculative_tokens": 8}'], adaptive=False)
    assert configs["none"] is None and configs["suffix"] == {"method": "suffix", "adaptive": False}
    assert configs["ngram8"] == {**speculative.METHODS["ngram"], "num_speculative_tokens": 8, "adaptive": False}
    for methods, overrides in ((["eagle"], []), (["none"], ['none={"method": "ngram"}']), (["ngram"], ["ngram=4"]),
                               (["ngram"], ['suffix={"method": "suffix"}']),
                               (["ngram"], ['ngram={"num_speculative_tokens": 0}'])):
        with pytest.raises(ValueError):
            speculative.method_configs(methods, overrides, None)


def test_main_on_a_tiny_model_writes_the_fields_and_identical_outputs(tmp_path, tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(speculative, "load_workload", lambda name, limit=None: PROMPTS[:limit])
    out = tmp_path / "spec.json"
    assert speculative.main(["workload", "--model", str(tiny_model_dirs["qwen3"]), "--methods", "none,ngram",
                             "--workload", "copy", "--max-tokens", "24", "--device", "cpu", "--out",
                             str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"none", "ngram"} and report["settings"]["device"] == "cpu"
    for method, run in report["runs"].items():
        rec = run["workloads"]["copy"]
        assert RECORD_FIELDS <= set(rec) and rec["prompts"] == 2 and len(rec["per_prompt"]["tok_s"]) == 2
        assert rec["identical_to_none"] and rec["mismatches"] == []
        assert rec["stats"]["generation_tokens"] == rec["output_tokens"] > 0
        loop = rec["loop"]  # the engine's own host counters: its work and its waits fit in the timed seconds
        assert loop["steps"] > 0 and 0 < loop["host_busy_us_per_step"]
        assert loop["host_busy_us_per_step"] + loop["host_wait_us_per_step"] <= loop["wall_us_per_step"]
        if method == "none":
            assert rec["speculation"] is None
        else:
            assert set(rec["speculation"]) == SPECULATION_FIELDS and rec["speculation"]["method"] == method
            assert rec["speculation"]["accepted_tokens"] > 0  # the tiny Qwen3's greedy output falls into loops
    assert all(t["met"] for t in report["targets"].values())  # CPU: the identity targets only
    lines = speculative.table_lines(report["runs"], report["targets"])
    assert len(lines) == 1 + len(report["runs"]) + len(report["targets"])


def test_spec_host_reports_the_loop_s_own_time(tmp_path, tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(spec_host, "load_workload", lambda name, limit=None: PROMPTS[:limit])
    out = tmp_path / "host.json"
    assert spec_host.main(["--model", str(tiny_model_dirs["qwen3"]), "--methods", "none,suffix", "--prompts", "2",
                           "--max-tokens", "16", "--breakdown", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    for method, run in runs.items():
        assert run["steps"] > 0 and run["tokens"] == 32  # (ignore_eos is off: the tiny model never says EOS)
        assert 0 < run["own_us_per_step"] < run["busy_us_per_step"] and run["own_us_per_token"] > 0
        assert run["busy_us_per_step"] == pytest.approx(run["own_us_per_step"] + run["execute_us_per_step"])
    assert runs["none"]["speculator_us_per_step"] is None and runs["none"]["speculation"] is None
    assert set(runs["suffix"]["speculator_us_per_step"]) <= set(spec_host.SPEC_CALLS)
    assert runs["suffix"]["speculation"]["method"] == "suffix"


def test_compare_lists_mismatches_and_ratios():
    runs = {m: {"workloads": {"copy": {"output_tok_s": tok_s}}} for m, tok_s in (("none", 10.0), ("ngram", 25.0))}
    outputs = {"none": {"copy": [[1, 2, 3], [4, 5]]}, "ngram": {"copy": [[1, 2, 3], [4, 6, 7]]}}
    speculative.compare_with_baseline(runs, outputs)
    rec = runs["ngram"]["workloads"]["copy"]
    assert rec["mismatches"] == [{"prompt": 1, "first_diff": 1, "tokens": [2, 3], "ids": [5, 6], "prefix": [4]}]
    assert not rec["identical_to_none"]
    assert rec["tok_s_vs_none"] == 2.5 and runs["none"]["workloads"]["copy"]["identical_to_none"]
    t = speculative.targets(runs, "cuda")
    assert t["copy / ngram / tok/s vs none"] == {"value": 2.5, "limit": 2.0, "met": True}
    assert t["copy / ngram / prompts whose output differs from none's"]["met"] is False
    assert "copy / ngram / tok/s vs none" not in speculative.targets(runs, "cpu")
    assert speculative.first_difference([1, 2, 3], [1, 5]) == 1 and speculative.first_difference([1], [1, 2]) == 1


def test_ties_price_both_tokens_at_the_first_difference(tmp_path, tiny_model_dirs, monkeypatch):
    """speculative_ties.py on a report whose one mismatch is made from none's own output: the engine picks none's
    token again, the gap is none's logprob minus the other's, and a mismatch where one output ended is skipped."""
    monkeypatch.setattr(speculative, "load_workload", lambda name, limit=None: PROMPTS[:limit])
    monkeypatch.setattr(speculative_ties, "load_workload", lambda name, limit=None: PROMPTS[:limit])
    model, report = str(tiny_model_dirs["qwen3"]), tmp_path / "spec.json"
    speculative.main(["workload", "--model", model, "--methods", "none", "--workload", "copy", "--max-tokens", "8",
                      "--device", "cpu", "--limit", "1", "--out", str(report)])
    from nanoserve import LLM, SamplingParams

    with LLM(model, **speculative.engine_options("cpu", None)) as llm:
        prompt = speculative.chat_ids(llm.tokenizer, PROMPTS[0]["messages"])
        ref = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2), use_tqdm=False)[0]
    top = ref.outputs[0].logprobs[3]
    other = next(t for t in top if t != ref.token_ids[3])
    data = json.loads(report.read_text())
    data["runs"]["ngram"] = {"workloads": {"copy": {"mismatches": [
        speculative.mismatch(0, ref.token_ids, ref.token_ids[:3] + [other]), speculative.mismatch(0, [1, 2], [1])]}}}
    report.write_text(json.dumps(data))
    out = tmp_path / "ties.json"
    assert speculative_ties.main([str(report), "--model", model, "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"] == {**result["summary"], "cases": 1, "outside_top": 0, "picks_none": 1}
    case = result["cases"][0]
    assert case["first_diff"] == 3 and case["ids"] == [ref.token_ids[3], other] and case["picks"] == "none"
    assert case["gap"] == pytest.approx(top[ref.token_ids[3]] - top[other], abs=1e-4)


def test_served_streams_carry_the_same_tokens_and_their_latencies(tmp_path, tiny_model_dirs, monkeypatch):
    """speculative_serve.py: a server per method, one stream at a time; token ids equal none's, per-token latency
    and chunk sizes recorded (the model drafting for itself: several tokens a chunk), offline ratios set beside."""
    monkeypatch.setattr(speculative, "load_workload", lambda name, limit=None: PROMPTS[:limit])
    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps({"runs": {"draft_model": {"workloads": {"copy": {"tok_s_vs_none": 1.5}}}}}))
    out = tmp_path / "serve.json"
    assert speculative_serve.main(["--model", str(tiny_model_dirs["qwen3"]), "--methods", "none,draft_model",
                                   "--workload", "copy", "--max-tokens", "16", "--device", "cpu",
                                   "--offline", str(offline), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    none, drafted = (report["runs"][m]["workloads"]["copy"] for m in ("none", "draft_model"))
    assert none["requests"] == drafted["requests"] == 2 and none["output_tokens"] == drafted["output_tokens"] > 0
    assert drafted["tokens_per_chunk"] > 1.0 <= none["tokens_per_chunk"]
    assert drafted["prompts_differing_from_none"] == 0 and drafted["tpot_ms"]["p50"] > 0
    assert drafted["offline_tok_s_vs_none"] == 1.5 and "served_over_offline" in drafted
    assert report["targets"]["copy / draft_model / prompts whose output differs from none's"]["met"]
