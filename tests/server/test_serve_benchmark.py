"""benchmarks/serve.py in its CPU smoke mode: a real `nanoserve serve` subprocess, client processes, the offline
engine on the same prompts, and a JSON report whose numbers hang together."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_serve_benchmark_smoke(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "benchmarks/serve.py", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "serve" and report["git_commit"] and report["date"]
    (model,) = report["models"]
    server, offline = model["server"], model["offline"]
    assert server["exit_code"] == 0, server["log_tail"]
    assert [lv["concurrency"] for lv in server["levels"]] == [lv["concurrency"] for lv in offline["levels"]] == [1, 4]
    for lv in server["levels"]:
        assert lv["completed"] == lv["num_prompts"] and lv["failed"] == lv["dropped"] == 0, lv
        assert lv["usage_matches"] and lv["tokens_per_chunk"] >= 1
        assert lv["engine"]["nanoserve_generation_tokens_total"] == lv["num_prompts"] * 8
        assert lv["output_throughput"] > 0 and lv["ratio_to_offline"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d = lv[metric]
            assert 0 < d["p50"] <= d["p99"] <= d["max"], (metric, d)
    assert offline["prefill_ms"] > 0 and offline["step_ms_b1"] > 0
    names = [t["target"] for t in model["targets"]]
    assert any("85% of offline" in n for n in names) and any("TTFT p50" in n for n in names)
    assert all(isinstance(t["met"], bool) for t in model["targets"])
