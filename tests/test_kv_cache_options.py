"""The FP8 KV cache's options: EngineConfig's kv_cache_dtype / kv_cache_scales (validated, one-line errors), their CLI
flags (serve, generate, bench), the start-up's choice of scale design (resolve_kv_scales), and what /metrics says
of the cache."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest

from nanoserve.cli import _build_parser, _engine_options, engine_config_from_args, main
from nanoserve.config import EngineConfig
from nanoserve.engine.messages import EngineStats
from nanoserve.runner.startup.kv_scales import resolve_kv_scales
from nanoserve.server.metrics import ServerMetrics


def test_the_defaults_keep_the_serving_dtype():
    config = EngineConfig("m")
    assert (config.kv_cache_dtype, config.kv_cache_scales) == ("auto", "auto")
    resolved = config.resolve(128, None)
    assert resolved.kv_torch_dtype == resolved.torch_dtype == torch.float32


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_is_float8_e4m3(name):
    config = EngineConfig("m", kv_cache_dtype=name, kv_cache_scales="token")
    assert config.kv_cache_dtype == "fp8"  # one name for both
    assert config.resolve(128, None).kv_torch_dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype must be one of ('auto', 'fp8', 'fp8_e4m3'), got 'fp8_e5m2'"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of ('auto', 'fp8', 'fp8_e4m3'), got 'int8'"),
    ({"kv_cache_dtype": "fp8", "kv_cache_scales": "head"},
     "kv_cache_scales must be one of ('auto', 'token', 'layer'), got 'head'"),
    ({"kv_cache_scales": "layer"}, "kv_cache_scales='layer' needs kv_cache_dtype='fp8'"),
])
def test_unknown_values_are_one_line_errors(options, message):
    with pytest.raises(ValueError) as e:
        EngineConfig("m", **options)
    assert str(e.value) == message


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["bench", "throughput"],
                                     ["bench", "latency"], ["bench", "graphs"]])
def test_the_flags_reach_the_engine_config(command):
    argv = command[:2] if command[0] == "bench" else command[:1]
    argv += ["--model", "m", *command[len(argv):], "--kv-cache-dtype", "fp8", "--kv-cache-scales", "token"]
    args = _build_parser().parse_args(argv)
    options = _engine_options(args)
    assert (options["kv_cache_dtype"], options["kv_cache_scales"]) == ("fp8", "token")
    config = engine_config_from_args(args)
    assert (config.kv_cache_dtype, config.kv_cache_scales) == ("fp8", "token")


def test_a_bad_flag_value_is_one_line(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--kv-cache-dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype must be one of" in err and err.count("\n") == 1, err


def model_with(*scales):
    """A stand-in for a loaded model: attention layers with these checkpoint_kv_scales (None: not scaled; a layer
    without the attribute is one the loader never set)."""
    layers = [SimpleNamespace() if s == "unset" else SimpleNamespace(checkpoint_kv_scales=s) for s in scales]
    return SimpleNamespace(attention_layers=lambda: layers)


@pytest.mark.parametrize("dtype, scales, layers, want", [
    ("auto", "auto", [(0.5, 0.25)], None),
    ("fp8", "auto", ["unset", None], "token"),
    ("fp8", "auto", [(0.5, 0.25), (1.0, 2.0)], "layer"),
    ("fp8", "token", [(0.5, 0.25), (1.0, 2.0)], "token"),
    ("fp8", "layer", [None, None], "layer"),  # uncalibrated: 1.0 (vLLM's default)
])
def test_auto_scales_follow_the_checkpoint(dtype, scales, layers, want):
    config = EngineConfig("m", kv_cache_dtype=dtype, kv_cache_scales=scales)
    assert resolve_kv_scales(config, model_with(*layers)) == want


def test_scales_on_some_layers_only_are_refused():
    config = EngineConfig("m", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"KV-cache scales for 2 of 3 attention layers \(none for layer 1\)") as e:
        resolve_kv_scales(config, model_with((0.5, 0.5), None, (0.5, 0.5)))
    assert "\n" not in str(e.value)


def test_metrics_say_what_the_cache_is():
    stats = EngineStats(kv_blocks_total=10, kv_cache_dtype="float8_e4m3fn", kv_cache_scales="token",
                        kv_block_bytes=4352)
    text = generate_latest(ServerMetrics(SimpleNamespace(stats=stats)).registry).decode()
    assert 'nanoserve_kv_cache_info{dtype="float8_e4m3fn",scales="token"} 1.0' in text
    assert "nanoserve_kv_cache_block_bytes 4352.0" in text
    stats = EngineStats(kv_cache_dtype="bfloat16", kv_block_bytes=8192)
    text = generate_latest(ServerMetrics(SimpleNamespace(stats=stats)).registry).decode()
    assert 'nanoserve_kv_cache_info{dtype="bfloat16",scales="none"} 1.0' in text
