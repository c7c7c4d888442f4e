"""`nanoserve bench latency | throughput` on a tiny model (CPU), the JSON record, the ShareGPT loader and the
Poisson arrivals. (`bench serve`: tests/server/test_bench_serve.py; `bench graphs`: tests/test_bench_graphs.py.)"""
from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from nanoserve.bench.common import arrival_offsets, distribution, environment, load_sharegpt, percentile, write_json
from nanoserve.cli import main
from nanoserve.model_files import load_tokenizer

CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                       {"from": "gpt", "value": "The capital of France is Paris."}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a colour."},
                       {"from": "gpt", "value": "Blue, the colour of the sky."}, {"from": "human", "value": "More"}]},
    {"conversations": [{"from": "human", "value": "Nobody answers this one."}]},  # no reply: skipped
    {"conversations": [{"from": "gpt", "value": "A reply first"}, {"from": "human", "value": "then a question"}]},
    {"id": "no conversations at all"},
    {"conversations": [{"from": "human", "value": "Count to five."}, {"from": "gpt", "value": "1 2 3 4 5"}]},
]


@pytest.fixture
def sharegpt(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    return path


def bench(capsys, *args) -> tuple[dict, str]:
    """Run `nanoserve bench ...` in this process; its --output-json record and what it printed."""
    out = capsys.readouterr  # flush what came before
    out()
    code = main(["bench", *args])
    captured = out()
    printed = captured.out
    assert code == 0, printed + captured.err  # (argparse and usage errors go to stderr)
    path = args[args.index("--output-json") + 1]
    return json.loads(open(path).read()), printed


def test_throughput_on_a_tiny_model(tiny_model_dirs, tmp_path, capsys):
    record, printed = bench(capsys, "throughput", "--model", str(tiny_model_dirs["qwen3"]), "--device", "cpu",
                            "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                            "--output-json", str(tmp_path / "t.json"))
    assert record["benchmark"] == "throughput" and record["num_requests"] == 4
    assert record["total_input_tokens"] == 32 and record["total_output_tokens"] == 16
    assert record["total_num_tokens"] == 48
    seconds = record["elapsed_time"]
    assert seconds > 0 and record["requests_per_second"] == pytest.approx(4 / seconds)
    assert record["output_tokens_per_second"] == pytest.approx(16 / seconds)
    assert record["tokens_per_second"] == pytest.approx(48 / seconds)
    assert record["settings"]["num_prompts"] == 4 and record["settings"]["device"] == "cpu"
    assert "Throughput:" in printed and "requests/s" in printed


def test_throughput_on_a_sharegpt_file(tiny_model_dirs, sharegpt, tmp_path, capsys):
    """Prompts are the first human turns; each generates as many tokens as its gpt reply has."""
    model = str(tiny_model_dirs["llama"])
    tokenizer = load_tokenizer(model)
    usable = [c["conversations"] for c in CONVERSATIONS if c.get("conversations") and len(c["conversations"]) > 1
              and c["conversations"][0]["from"] != "gpt"]
    prompts = {turns[0]["value"] if turns[0]["from"] == "human" else turns[1]["value"] for turns in usable}
    replies = [turns[1]["value"] if turns[0]["from"] == "human" else turns[2]["value"] for turns in usable]
    record, _ = bench(capsys, "throughput", "--model", model, "--device", "cpu", "--num-prompts", "3",
                      "--dataset-path", str(sharegpt), "--output-json", str(tmp_path / "s.json"))
    assert record["num_requests"] == 3
    assert record["total_output_tokens"] == sum(len(tokenizer.encode(r, add_special_tokens=False)) for r in replies)
    assert record["total_input_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    fixed, _ = bench(capsys, "throughput", "--model", model, "--device", "cpu", "--num-prompts", "3",
                     "--dataset-path", str(sharegpt), "--output-len", "5", "--output-json", str(tmp_path / "f.json"))
    assert fixed["total_output_tokens"] == 15


def test_latency_on_a_tiny_model(tiny_model_dirs, tmp_path, capsys):
    record, printed = bench(capsys, "latency", "--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu",
                            "--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "3",
                            "--num-iters-warmup", "1", "--output-json", str(tmp_path / "l.json"))
    latencies = record["latencies"]
    assert record["benchmark"] == "latency" and len(latencies) == 3 and all(t > 0 for t in latencies)
    assert record["avg_latency"] == pytest.approx(statistics.fmean(latencies))
    assert list(record["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert record["percentiles"]["50"] == pytest.approx(statistics.median(latencies))
    assert min(latencies) <= record["percentiles"]["10"] <= record["percentiles"]["99"] <= max(latencies)
    assert "Avg latency:" in printed and "99% percentile latency:" in printed


def test_latency_prefills_fresh_prompts_every_run(tiny_model_dirs):
    """No run reuses another's KV cache through prefix caching: each draws new prompts."""
    from nanoserve import LLM
    from nanoserve.bench.offline import run_latency

    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", enable_prefix_caching=True, show_progress=False)
    run_latency(llm, 2, 64, 2, num_iters=2, num_iters_warmup=1, log=lambda _: None)
    assert llm.engine.stats.prefix_cache_hit_tokens == 0
    llm.close()


def test_bench_errors_are_one_line(tiny_model_dirs, sharegpt, capsys):
    model = str(tiny_model_dirs["qwen3"])
    assert main(["bench", "latency", "--model", model, "--device", "cpu", "--batch-size", "0"]) == 2
    assert "--batch-size must be positive" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", model, "--device", "cpu", "--skip-tokenizer-init",
                 "--dataset-path", str(sharegpt), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs the model's tokenizer" in err and err.count("\n") == 1, err
    assert main(["bench", "throughput", "--model", model, "--device", "cpu", "--dataset-path", str(sharegpt),
                 "--num-prompts", "9"]) == 2
    err = capsys.readouterr().err
    assert "has 3 usable conversations" in err and "asks for 9" in err and err.count("\n") == 1, err


def test_sharegpt_loader(tiny_model_dirs, sharegpt, tmp_path):
    tokenizer = load_tokenizer(str(tiny_model_dirs["qwen3"]))
    requests = load_sharegpt(sharegpt, tokenizer, 3, seed=0)
    assert sorted(r.prompt for r in requests) == ["Count to five.", "Name a colour.", "What is the capital of France?"]
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt)) and r.output_len >= 1
    assert [r.prompt for r in load_sharegpt(sharegpt, tokenizer, 3, seed=0)] == [r.prompt for r in requests]
    assert {r.prompt for r in load_sharegpt(sharegpt, tokenizer, 1, seed=1)} <= {r.prompt for r in requests}
    assert all(r.output_len == 7 for r in load_sharegpt(sharegpt, tokenizer, 3, output_len=7))
    longest = max(r.prompt_len + r.output_len for r in requests)
    assert len(load_sharegpt(sharegpt, tokenizer, 2, max_model_len=longest - 1)) == 2  # the longest one is skipped
    with pytest.raises(ValueError, match="has 2 usable conversations"):
        load_sharegpt(sharegpt, tokenizer, 3, max_model_len=longest - 1)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the dataset"):
        load_sharegpt(tmp_path / "bad.json", tokenizer, 1)
    (tmp_path / "dict.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        load_sharegpt(tmp_path / "dict.json", tokenizer, 1)


def test_poisson_arrivals():
    rate = 50.0
    offsets = arrival_offsets(20_000, rate, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean
    assert arrival_offsets(50, rate, seed=3) == offsets[:50]  # seeded
    assert arrival_offsets(50, rate, seed=4) != offsets[:50]
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    with pytest.raises(ValueError, match="--request-rate must be positive"):
        arrival_offsets(4, 0)


def test_percentiles_and_the_record(tmp_path):
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(sorted(values), 50) == 2.5 and percentile(sorted(values), 99) == pytest.approx(3.97)
    assert distribution(values, scale=1.0) == {"mean": 2.5, "p50": 2.5, "p99": pytest.approx(3.97), "max": 4.0}
    assert distribution([]) is None
    path = write_json(tmp_path / "a" / "r.json", {"x": float("nan"), "p": tmp_path, "t": (1, 2)})
    assert json.loads(path.read_text()) == {"x": None, "p": str(tmp_path), "t": [1, 2]}
    env = environment()
    assert env["torch"] == torch.__version__ and env["date"] and env["command"] and env["nanoserve"]
    assert env["cpu"] and (env["gpu"] is not None) == torch.cuda.is_available()
    assert {"triton", "transformers", "git_commit", "python"} <= set(env)


def test_profile_needs_a_gpu_and_says_so(tiny_model_dirs, capsys):
    code = main(["bench", "latency", "--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu", "--profile"])
    assert code == 2 and "--profile reads the GPU's kernels: it needs a CUDA device" in capsys.readouterr().err


def test_kernel_kinds_and_their_report():
    from nanoserve.bench.profile import format_kinds, kernel_kind, kind_table

    assert [kernel_kind(n) for n in ("_gemv_gate_up_kernel", "_grouped_gemm_kernel", "_route_kernel",
                                     "_align_kernel", "_decode_kernel")] == ["experts", "experts", "routing",
                                                                             "routing", "attention"]
    table = kind_table([("_route_kernel", 0.0, 2.0), ("_gemv_gate_up_kernel", 2.0, 10.0),
                        ("_decode_kernel", 10.0, 12.0), ("nvjet_head", 12.0, 20.0)])
    lines = format_kinds(table)
    assert lines[0] == "4 kernels, 20 us busy over a 20 us span"
    assert any(line.split()[:4] == ["experts", "1", "kernels", "8"] and line.endswith("40.0%") for line in lines)
    assert not any(line.split()[0] == "norm" for line in lines[1:])  # kinds that did not run are left out


@pytest.mark.gpu
def test_latency_profile_on_the_gpu(tiny_model_dirs, tmp_path, capsys):
    # (a fixed cache: sized from free memory it may not hold max_model_len beside other GPU workers: exit 2, twice)
    record, printed = bench(capsys, "latency", "--model", str(tiny_model_dirs["qwen3"]), "--batch-size", "2",
                            "--input-len", "8", "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
                            "--max-model-len", "256", "--num-kv-blocks", "256", "--profile",
                            "--output-json", str(tmp_path / "p.json"))
    assert record["profile"]["kernels"] > 0 and "attention" in printed
