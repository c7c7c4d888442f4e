"""The demo scripts (run.py, examples/cuda_graph_reference.py) and the decode-latency benchmark.

CPU: the scripts exit 0 without a GPU and say what they would show; the benchmark's pure helpers
(parameter and HBM-floor byte counting, bucketing, KV sizing) match hand-computed numbers and
Hugging Face's own parameter counts; the GPU code paths run on a tiny CPU engine.
GPU (-m gpu): the static-address experiment and short runs of run.py and decode_latency.py.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import run  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import decode_latency as dl  # noqa: E402

gpu = pytest.mark.gpu


def _run(args: list[str], hide_gpu: bool, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _key_values(stdout: str) -> dict[str, str]:
    """key=value tokens of the example's output lines."""
    out = {}
    for line in stdout.splitlines():
        for token in line.split():
            if "=" in token:
                key, _, value = token.partition("=")
                out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# Scripts without a GPU


def test_cuda_graph_reference_without_gpu_explains_and_exits_0():
    proc = _run(["examples/cuda_graph_reference.py"], hide_gpu=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    assert "CUDA is not available" in lines[0]
    assert "replay" in lines[1] and "data_ptr" in lines[1] and "eager" in lines[1]


def test_run_py_without_gpu_explains_and_generates_on_cpu():
    proc = _run(["run.py"], hide_gpu=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "no CUDA GPU" in out
    assert "captures one decode graph per batch-size bucket" in out and "padding rows" in out
    assert "0 on graphs" in out and "eager" in out
    generated = [line for line in out.splitlines() if line.strip().startswith("→ [")]
    assert len(generated) == 3 and all(line.count(",") == 15 for line in generated), out  # 16 tokens each


def test_decode_latency_help():
    proc = _run(["benchmarks/decode_latency.py", "--help"], hide_gpu=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in ("--models", "--batch-sizes", "--context", "--out"):
        assert option in proc.stdout


def test_decode_latency_without_gpu_says_so():
    proc = _run(["benchmarks/decode_latency.py"], hide_gpu=True, timeout=120)
    assert proc.returncode == 1
    assert "needs a GPU" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Byte counting, by hand


def test_param_counts_qwen3_0_6b_by_hand():
    p = common.param_counts(common.model_config("qwen3-0.6b"))
    # q 1024×2048, k and v 1024×1024 each, o 2048×1024, q/k norm 2×128, MLP 3×1024×3072, 2 norms × 1024
    per_layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024
    assert per_layer == 15_730_944
    assert p.per_layer == per_layer and p.layers == 28 * per_layer
    assert p.embedding == 151936 * 1024 and p.lm_head == 0  # tied
    assert p.total == 596_049_920  # the published "0.6B"


def test_param_counts_llama_3_1_8b_by_hand():
    p = common.param_counts(common.model_config("llama-3.1-8b"))
    per_layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert per_layer == 218_112_000
    assert p.per_layer == per_layer
    assert p.embedding == p.lm_head == 128256 * 4096
    assert p.total == 8_030_261_248  # the published "8.03B"


def test_smollm2_shape_is_the_published_135m():
    cfg = common.model_config("smollm2-135m")
    p = common.param_counts(cfg)
    assert p.total == 134_515_008  # SmolLM2-135M's parameter count
    assert p.lm_head == 0 and p.embedding == 49152 * 576  # tied
    assert common.decode_bytes(cfg, 1, 0).weights == 134_515_008 * 2
    args = dl.parse_args(["--models", "smollm2-135m", "--batch-sizes", "1", "32"])
    assert args.models == ["smollm2-135m"] and args.batch_sizes == [1, 32]


def test_decode_bytes_qwen3_tied_counts_the_table_once():
    cfg = common.model_config("qwen3-0.6b")
    d = common.decode_bytes(cfg, batch_size=1, context=512)
    # all layers + final norm + the tied embedding/lm_head read whole once, bf16
    assert d.weights == (28 * 15_730_944 + 1024 + 151936 * 1024) * 2 == 1_192_099_840
    assert d.kv == 512 * (2 * 28 * 8 * 128 * 2) == 58_720_256
    assert common.decode_bytes(cfg, 64, 512).weights == d.weights  # tied: no extra rows per batch row
    # PERF-NOTES: Qwen3-0.6B floor at b=1 with no context ≈ 0.28 ms at 4.3 TB/s
    assert common.hbm_floor_ms(cfg, 1, 0, 4.3e12) == pytest.approx(1_192_099_840 / 4.3e12 * 1e3)
    assert round(common.hbm_floor_ms(cfg, 1, 0, 4.3e12), 2) == 0.28


def test_decode_bytes_llama_untied_reads_lm_head_whole_and_b_embedding_rows():
    cfg = common.model_config("llama-3.1-8b")
    d = common.decode_bytes(cfg, batch_size=4, context=512)
    layers = 32 * 218_112_000
    assert d.weights == (layers + 4096 + 128256 * 4096 + 4 * 4096) * 2 == 15_009_882_112
    assert d.kv == 4 * 512 * (2 * 32 * 8 * 128 * 2) == 268_435_456
    assert d.total == d.weights + d.kv
    assert round(common.hbm_floor_ms(cfg, 1, 0, 4.3e12), 2) == 3.49  # PERF-NOTES: 3.50 (b=1, context 128)
    with pytest.raises(ValueError, match="bandwidth"):
        common.hbm_floor_ms(cfg, 1, 0, 0.0)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m", "qwen2-small", "llama-bias-small"])
def test_param_counts_match_transformers(name):
    """Our counting vs the reference implementation's parameters (built on the meta device: no memory)."""
    import transformers

    if name == "qwen2-small":
        cfg = dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True,
                   max_position_embeddings=128)
    elif name == "llama-bias-small":
        cfg = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=24, vocab_size=300,
                   tie_word_embeddings=False, attention_bias=True, mlp_bias=True, max_position_embeddings=128)
    else:
        cfg = common.model_config(name)
    config_cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
                  "llama": transformers.LlamaConfig}[cfg["model_type"]]
    hf_config = config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert common.param_counts(cfg).total == sum(p.numel() for p in model.parameters())


def test_written_config_loads_with_the_engine_loader(tmp_path):
    from nanoserve.model_files import load_hf_config, model_max_len

    for name, max_len, kv_heads, head_dim in (("qwen3-0.6b", 40960, 8, 128), ("llama-3.1-8b", 131072, 8, 128),
                                              ("smollm2-135m", 8192, 3, 64)):
        path = common.write_model_dir(name, tmp_path / name)
        assert json.loads((path / "config.json").read_text()) == common.model_config(name)
        hf = load_hf_config(str(path))
        assert model_max_len(hf) == max_len
        assert hf.num_key_value_heads == kv_heads and hf.head_dim == head_dim
    with pytest.raises(KeyError, match="known"):
        common.model_config("gpt-5")


# ---------------------------------------------------------------------------------------------
# Small helpers


def test_buckets_and_padding():
    sizes = common.power_of_two_sizes(256)
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert common.power_of_two_sizes(6) == [1, 2, 4, 6]  # the engine's default buckets end at max_num_seqs
    assert common.bucket_for(5, sizes) == 8 and common.padding_rows(5, sizes) == 3
    assert common.bucket_for(8, sizes) == 8 and common.padding_rows(8, sizes) == 0
    assert common.bucket_for(129, sizes) == 256 and common.padding_rows(129, sizes) == 127
    assert common.bucket_for(257, sizes) is None and common.padding_rows(257, sizes) == 0  # runs eagerly


def test_kv_sizing():
    assert common.kv_blocks_needed(256, 512, 16) == 256 * 32 + 1
    assert common.kv_blocks_needed(3, 17, 16, spare=0) == 6
    with pytest.raises(ValueError):
        common.kv_blocks_needed(0, 512, 16)
    assert common.kv_bytes_per_token(common.model_config("llama-3.1-8b")) == 2 * 32 * 8 * 128 * 2 == 131072
    assert dl.kv_tokens_per_seq(512, 10) == 512 + dl.E2E_WARMUP_STEPS + dl.E2E_RUNS * 10 + dl.E2E_EXTRA_TOKENS + 1


def test_fit_batch_sizes_drops_the_largest_until_it_fits():
    cfg = common.model_config("llama-3.1-8b")
    weights = common.param_counts(cfg).total * 2
    per_row = 34 * 16 * 131072  # 34 blocks of 16 tokens for 530 tokens
    sizes, blocks = common.fit_batch_sizes(cfg, [1, 2, 4, 8], 530, 16, free_bytes=10**15)
    assert sizes == [1, 2, 4, 8] and blocks == 8 * 34 + 2
    free = int((weights + 4 * per_row + 2 * 16 * 131072) / 0.8) + 1  # exactly room for b = 4
    sizes, blocks = common.fit_batch_sizes(cfg, [8, 1, 4, 2], 530, 16, free_bytes=free)
    assert sizes == [1, 2, 4] and blocks == 4 * 34 + 2
    assert common.fit_batch_sizes(cfg, [1], 530, 16, free_bytes=weights) == ([], 0)


def test_time_and_summaries_on_cpu(tmp_path):
    calls = []
    samples = common.time_ms(lambda: calls.append(1), "cpu", warmup=2, iters=5)
    assert len(samples) == 5 and len(calls) == 7 and all(s >= 0 for s in samples)
    s = common.summarize_ms([3.0, 1.0, 2.0, 10.0, 4.0])
    assert s == {"median": 3.0, "min": 1.0, "p90": 10.0, "n": 5}
    with pytest.raises(ValueError):
        common.summarize_ms([])
    path = common.write_json(tmp_path / "a" / "r.json", {"x": float("nan"), "p": Path("/q"), "t": (1, 2)})
    assert json.loads(path.read_text()) == {"x": None, "p": "/q", "t": [1, 2]}
    env = common.env_info()
    assert env["torch"] == torch.__version__ and env["date"] and "command" in env


def test_decode_latency_args_are_normalised():
    args = dl.parse_args(["--batch-sizes", "8", "1", "8", "4", "--e2e-batch-sizes", "16", "4", "1"])
    assert args.batch_sizes == [1, 4, 8]
    assert args.e2e_batch_sizes == [1, 4]  # 16 > the largest measured batch
    assert dl.parse_args([]).batch_sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert dl.parse_args([]).models == ["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m"]
    assert dl.parse_args([]).context == 512
    with pytest.raises(SystemExit):
        dl.parse_args(["--batch-sizes", "0"])


def test_compare_tokens_explains_divergences():
    def out(tokens, logprobs=None):
        return SimpleNamespace(token_ids=tokens, logprobs=logprobs)

    eager = [out([1, 2, 3]), out([1, 2, 3], [{1: -0.1}, {2: -1.00, 9: -1.02}, {3: -0.5}]),
             out([4, 5], [{4: -0.1, 6: -3.0}, {5: -0.2}]), out([7, 8], [{7: -0.1}, {8: -0.2}])]
    graph = [out([1, 2, 3]), out([1, 9, 4]), out([6, 5]), out([7, 3])]
    same, divs = run.compare_tokens(graph, eager, tol=0.1)
    assert same == 1 and [d.index for d in divs] == [1, 2, 3]
    tie, not_tie, unknown = divs
    assert (tie.position, tie.eager_token, tie.graph_token) == (1, 2, 9)
    assert tie.gap == pytest.approx(0.02) and tie.near_tie
    assert not_tie.gap == pytest.approx(2.9) and not not_tie.near_tie
    assert unknown.gap is None and not unknown.near_tie  # graph token not among eager's top-N


def test_argmax_gap():
    ref = torch.tensor([[0.0, 1.0, 0.99], [2.0, 0.0, 0.0]])
    assert run.argmax_gap(ref, ref) == 0.0
    out = torch.tensor([[0.0, 0.98, 0.995], [2.0, 0.0, 0.0]])
    assert run.argmax_gap(ref, out) == pytest.approx(0.01)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"batch_size": b, "eager_ms": 10.0, "graph_ms": 2.0 + b / 64, "floor_ms": 0.3 + b / 1000}
            for b in (1, 8, 64)]
    report = {"env": {"gpu": "test", "torch": "x", "date": "2026-01-01"},
              "settings": {"dtype": "bfloat16", "context": 512},
              "models": [{"model": "m1", "decode": rows, "e2e": [{"batch_size": 8, "step_ms": 3.0}]},
                         {"model": "m2", "decode": rows + [{"batch_size": 256, "error": "boom"}], "e2e": []},
                         {"model": "failed", "error": "oom", "decode": []}]}
    path = dl.plot(report, tmp_path / "p.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert dl.plot({**report, "models": report["models"][2:]}, tmp_path / "q.png") is None


# ---------------------------------------------------------------------------------------------
# The GPU code paths on a tiny CPU engine (graphs fall back to eager there)


def _small_qwen3() -> dict:
    return common.model_config("qwen3-0.6b") | dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=512, bos_token_id=1, eos_token_id=2)


def test_decode_latency_measure_model_on_cpu(monkeypatch):
    """Engine options, the decode/e2e loops and the JSON-able result, on a tiny dummy model."""
    monkeypatch.setattr(dl, "model_config", lambda name: _small_qwen3())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU even on a GPU machine
    args = dl.parse_args(["--models", "qwen3-0.6b", "--context", "64", "--iters", "2", "--warmup", "1",
                          "--e2e-steps", "2", "--batch-sizes", "1", "2", "4", "--e2e-batch-sizes", "1", "4"])
    result = dl.measure_model("qwen3-0.6b", args, bandwidth=1e12)
    assert "error" not in result, result.get("error")
    assert [r["batch_size"] for r in result["decode"]] == [1, 2, 4]
    for r in result["decode"]:
        assert "error" not in r and r["eager_ms"] > 0 and r["floor_ms"] > 0
        assert "graph_ms" not in r  # CPU: no graph runner
    assert [r["batch_size"] for r in result["e2e"]] == [1, 4]
    for r in result["e2e"]:
        assert "error" not in r and "warning" not in r, r
        assert r["rows_per_step"] == [r["batch_size"]] and r["step_ms"] > 0 and r["prefill_steps"] >= 1
    assert result["capture"] is None and result["max_model_len"] == 1024
    assert result["kv_blocks_total"] == result["kv_blocks_requested"] >= 1024 // 16
    json.dumps(common._json_safe(result))


def test_run_py_gpu_sections_on_cpu(tmp_path, capsys):
    """bucket_table and generation_check run end to end on a CPU engine (eager both ways)."""
    from nanoserve import LLM

    model_dir = common.write_model_dir(_small_qwen3(), tmp_path / "m")
    options = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8,
                   enable_prefix_caching=False)

    class CpuLLM(LLM):
        def __init__(self, model, dtype, **kw):
            super().__init__(model, device="cpu", dtype=dtype, **kw)

    llm = CpuLLM(str(model_dir), dtype="float32", num_kv_blocks=64, **options)
    failures = run.bucket_table(llm.engine.model_runner, [1, 2, 4, 8],
                                SimpleNamespace(context=64, iters=2))
    assert failures == []
    table = capsys.readouterr().out
    assert "bucket" in table and "│        5        3    38%" in table  # b = 4 + 1 pads 3 rows of bucket 8
    failures = run.generation_check(None, CpuLLM, model_dir, _small_qwen3(), "float32", options, 512)
    out = capsys.readouterr().out
    assert "float32: 6/6 sequences identical to enforce_eager" in out
    assert failures == ["float32: no decode step used a graph"]  # CPU has no graphs


# ---------------------------------------------------------------------------------------------
# GPU


@gpu
def test_cuda_graph_reference_on_gpu(tmp_path):
    out_json = tmp_path / "ref.json"
    proc = _run(["examples/cuda_graph_reference.py", "--rounds", "50", "--json", str(out_json)], hide_gpu=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kv = _key_values(proc.stdout)
    assert kv["python"] and kv["torch"] == torch.__version__ and kv["device"]
    assert int(kv["input_ptr_static"]) > 0 and int(kv["output_ptr_static"]) > 0
    assert float(kv["max_abs_diff"]) <= 1e-5
    assert float(kv["eager_median_us"]) > 0 and float(kv["copy_plus_graph_replay_median_us"]) > 0
    assert kv["dynamic_shape_rejected"] == "RuntimeError"
    data = json.loads(out_json.read_text())
    assert data["input_ptr_static"] == int(kv["input_ptr_static"]) and data["dynamic_shape_rejected"] == "RuntimeError"
    assert data["replays"] > 50


@gpu
def test_run_py_on_gpu():
    proc = _run(["run.py", "--max-num-seqs", "16", "--iters", "5"], hide_gpu=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "capture: 5 graphs (batch sizes [1, 2, 4, 8, 16])" in out
    assert "bfloat16: " in out and "float32: 6/6 sequences identical to enforce_eager" in out
    assert "all checks passed" in out


@gpu
def test_decode_latency_short_run_on_gpu(tmp_path):
    proc = _run(["benchmarks/decode_latency.py", "--models", "qwen3-0.6b", "--batch-sizes", "1", "8",
                 "--iters", "5", "--e2e-batch-sizes", "8", "--e2e-steps", "3", "--out", str(tmp_path)],
                hide_gpu=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "decode_latency.json").read_text())
    assert report["env"]["gpu"] and report["copy_bandwidth_bytes_per_s"] > 1e11
    (model,) = report["models"]
    assert "error" not in model and model["capture"]["sizes"] == [1, 8] and model["capture"]["pool_mib"] >= 0
    for row in model["decode"]:
        assert "error" not in row, row
        assert row["graph_ms"] > 0 and row["eager_ms"] > 0 and row["floor_ms"] < row["graph_ms"]
        assert row["max_abs_logit_diff"] < 0.5 and math.isfinite(row["speedup"])
    (e2e,) = model["e2e"]
    assert "error" not in e2e and e2e["graph_steps"] == 3 * dl.E2E_RUNS and e2e["rows_per_step"] == [8]
    assert (tmp_path / "decode_latency.png").stat().st_size > 0
