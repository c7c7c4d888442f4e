"""The demo scripts (run.py, examples/cuda_graph_reference.py) and benchmarks/common.py's real shapes.

CPU: the scripts exit 0 without a GPU and say what they would show; the byte counting (parameters, KV, padding)
matches hand-computed numbers and Hugging Face's own parameter counts; run.py's GPU sections run on a tiny CPU
engine. GPU (-m gpu): the static-address experiment and a short run of run.py.
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


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b", "smollm2-135m", "qwen2-small", "llama-bias-small",
                                  "qwen3-30b-a3b", "mixtral-8x7b", "qwen2-moe-small"])
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
    elif name == "qwen2-moe-small":
        cfg = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_experts=6, num_experts_per_tok=2,
                   moe_intermediate_size=24, shared_expert_intermediate_size=40, decoder_sparse_step=2,
                   mlp_only_layers=[3], tie_word_embeddings=False, max_position_embeddings=128)
    else:
        cfg = common.model_config(name)
    config_cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
                  "llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
                  "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig}[cfg["model_type"]]
    hf_config = config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert common.param_counts(cfg).total == sum(p.numel() for p in model.parameters())


def test_moe_active_and_decode_counts():
    p = common.param_counts(common.model_config("qwen3-30b-a3b"))
    assert 30.4e9 < p.total < 30.6e9 and 3.3e9 < p.active + p.embedding < 3.4e9  # "30B-A3B"
    assert 2 * p.active == pytest.approx(6.1e9, rel=0.01)  # the b=1 decode floor's bytes
    assert p.decode_read(1) == p.active  # one token reads its top-k experts
    assert p.decode_read(10_000) == p.total - p.embedding  # every expert
    m = common.param_counts(common.model_config("mixtral-8x7b"))
    assert 46.6e9 < m.total < 46.8e9 and 12.8e9 < m.active + m.embedding < 13.0e9  # "12.9B active"


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


def test_padding_rows():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert common.padding_rows(5, sizes) == 3 and common.padding_rows(8, sizes) == 0
    assert common.padding_rows(129, sizes) == 127
    assert common.padding_rows(257, sizes) == 0  # larger than every graph: runs eagerly


def test_kv_sizing():
    assert common.kv_blocks_needed(256, 512, 16) == 256 * 32 + 1
    assert common.kv_blocks_needed(3, 17, 16, spare=0) == 6
    with pytest.raises(ValueError):
        common.kv_blocks_needed(0, 512, 16)
    assert common.kv_bytes_per_token(common.model_config("llama-3.1-8b")) == 2 * 32 * 8 * 128 * 2 == 131072


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


# ---------------------------------------------------------------------------------------------
# The GPU code paths on a tiny CPU engine (graphs fall back to eager there)


def _small_qwen3() -> dict:
    return common.model_config("qwen3-0.6b") | dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=512, bos_token_id=1, eos_token_id=2)


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
    runner = llm.engine.core.runner  # the "graph" engine is eager too on a CPU
    failures = run.bucket_table(runner, runner, [1, 2, 4, 8], SimpleNamespace(context=64, iters=2))
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


