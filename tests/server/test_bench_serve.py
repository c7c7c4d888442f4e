"""`nanoserve bench serve` against the package's live server (the tiny model, --api-key): the figures, the
concurrency limit, Poisson arrivals, a ShareGPT file, and one-line errors."""
from __future__ import annotations

import json
import random

import pytest

from nanoserve.bench.common import arrival_offsets, random_requests
from nanoserve.bench.serve import run_load, summarize
from nanoserve.cli import main
from tests.server.conftest import API_KEY, MODEL


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)


def test_bench_serve_reports_what_vllm_bench_serve_does(live, model_dir, api_key, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", live.base_url, "--tokenizer", model_dir, "--num-prompts", "6",
                 "--input-len", "8", "--output-len", "4", "--max-concurrency", "2", "--request-rate", "200",
                 "--client-processes", "1", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    record = json.loads(out.read_text())
    assert record["benchmark"] == "serve" and record["settings"]["max_concurrency"] == 2
    assert (record["completed"], record["failed"], record["dropped"]) == (6, 0, 0)
    assert record["total_input_tokens"] == 48 and record["total_output_tokens"] == 24 and record["usage_matches"]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = record[metric]
        assert 0 < d["p50"] <= d["p99"] <= d["max"] and d["mean"] > 0, (metric, d)
    assert record["ttft_ms"]["max"] <= record["e2el_ms"]["max"]
    assert record["request_throughput"] == pytest.approx(6 / record["duration_s"])
    assert record["output_throughput"] == pytest.approx(24 / record["duration_s"])
    for line in ("Successful requests:", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                 "Output token throughput (tok/s):"):
        assert line in printed
    assert f"({MODEL})" in printed  # the model name came from the server's /v1/models


def test_run_load_keeps_to_the_concurrency_and_the_arrivals(live, model_dir, api_key):
    requests = random_requests(random.Random(1), 8, 8, 3, 200)
    records, start, _, processes = run_load(live.base_url, MODEL, requests, max_concurrency=2, request_rate=40.0,
                                            seed=5, client_processes=2)
    assert processes == 2 and all(r.ok for r in records), [r.error for r in records]
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    in_flight = [sum(d for _, d in events[:i + 1]) for i in range(len(events))]
    assert max(in_flight) <= 2
    # each client sends its share (every other request) no earlier than its arrival time
    offsets = arrival_offsets(8, 40.0, seed=5)
    sent = sorted(r.start - start for r in records)
    assert sent[-1] >= sorted(offsets)[-1] - 0.05
    assert summarize(records, start)["completed"] == 8


def test_bench_serve_on_a_sharegpt_file(live, model_dir, api_key, tmp_path, capsys):
    from nanoserve.model_files import load_tokenizer

    data = [{"conversations": [{"from": "human", "value": f"Question {i}?"},
                               {"from": "gpt", "value": "An answer " * (i + 1)}]} for i in range(3)]
    (tmp_path / "d.json").write_text(json.dumps(data))
    out = tmp_path / "s.json"
    assert main(["bench", "serve", "--base-url", live.base_url, "--model", MODEL, "--tokenizer", model_dir,
                 "--dataset-path", str(tmp_path / "d.json"), "--num-prompts", "3", "--num-warmups", "0",
                 "--output-json", str(out)]) == 0, capsys.readouterr().out
    record = json.loads(out.read_text())
    tokenizer = load_tokenizer(model_dir)
    assert record["completed"] == 3 and record["total_output_tokens"] == sum(
        len(tokenizer.encode(c["conversations"][1]["value"], add_special_tokens=False)) for c in data)


def test_bench_serve_errors_are_one_line(live, model_dir, api_key, capsys, monkeypatch):
    assert main(["bench", "serve", "--port", "1", "--tokenizer", model_dir, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:1" in err and err.count("\n") == 1, err
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    assert main(["bench", "serve", "--base-url", live.base_url, "--model", MODEL, "--tokenizer", model_dir,
                 "--num-prompts", "1", "--input-len", "4", "--output-len", "2"]) == 2
    err = capsys.readouterr().err
    assert "the warm-up request" in err and "HTTP 401" in err and err.count("\n") == 1, err
    assert main(["bench", "serve", "--base-url", live.base_url, "--model", MODEL, "--tokenizer", model_dir,
                 "--endpoint", "/v1/chat/completions", "--num-prompts", "1"]) == 2
    assert "streams the completions API" in capsys.readouterr().err


def test_bench_serve_finds_the_tokenizer_from_the_server(live, model_dir, api_key, capsys):
    """The server's name (`tiny`, as --served-model-name gives) is no path: the tokenizer comes from the path its
    /v1/models card gives as root."""
    assert live.model != model_dir
    assert main(["bench", "serve", "--base-url", live.base_url, "--num-prompts", "2", "--input-len", "4",
                 "--output-len", "2", "--client-processes", "1", "--num-warmups", "0"]) == 0, capsys.readouterr()
    assert f"({MODEL})" in capsys.readouterr().out
