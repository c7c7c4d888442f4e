"""Fail before the expensive part (issue 17, case 6): what the model's config and this machine decide alone
(head / KV-head / intermediate / vocab divisibility by tensor_parallel_size, a GPU for each rank, bfloat16 on
the device, the checkpoint's weight format) is refused before any weight is read or process started. The
model folders here have no weight file at all: an error about the weights would mean the check came late."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from nanoserve import LLM
from nanoserve.config import EngineConfig
from nanoserve.engine import preflight


def _weightless(src, dst, **config_changes) -> str:
    """A copy of a model folder without its weights, its config.json changed."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(dst)


@pytest.mark.parametrize("changes,tp,words", [
    ({}, 3, "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4, "does not divide num_key_value_heads=6"),
    ({"intermediate_size": 130}, 4, "does not divide intermediate_size=130"),
    ({"vocab_size": 511}, 2, "does not divide vocab_size=511"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, 1, "quant_method='gptq'"),
])
def test_config_only_errors_come_before_the_weights(tiny_model_dirs, tmp_path, changes, tp, words):
    model = _weightless(tiny_model_dirs["qwen3"], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=re.escape(words)):
        LLM(model, device="cpu", tensor_parallel_size=tp, max_model_len=64, num_kv_blocks=16)


def test_serve_refuses_a_model_the_ranks_cannot_share_at_once(tiny_model_dirs, tmp_path):
    """`nanoserve serve -tp 3` on 4 heads: exit 2 with one line, before a tokenizer loads or the core starts."""
    model = _weightless(tiny_model_dirs["qwen3"], tmp_path / "m")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "nanoserve", "serve", "--model", model, "-tp", "3", "--device",
                           "cpu", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "nanoserve: error: tensor_parallel_size=3 does not divide num_attention_heads=4"
    assert "engine core" not in proc.stdout + proc.stderr
    assert time.monotonic() - started < 60


def test_bfloat16_or_an_fp8_kv_cache_on_a_gpu_without_it_is_refused(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    config = EngineConfig(str(tiny_model_dirs["qwen3"]), device="cuda:0", dtype="bfloat16").resolve(64, None)
    with pytest.raises(ValueError, match="dtype=bfloat16 needs a GPU of compute capability 8.0 or newer; cuda:0 "
                                         "is 7.5: use --dtype float16"):
        preflight.check_dtype(config)
    preflight.check_dtype(EngineConfig(str(tiny_model_dirs["qwen3"]), device="cuda:0",
                                       dtype="float16").resolve(64, None))
    fp8_kv = EngineConfig(str(tiny_model_dirs["qwen3"]), device="cuda:0", dtype="float16", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8 needs a GPU of compute capability 8.9 or newer; cuda:0 "
                                         "is 7.5: leave --kv-cache-dtype auto"):
        preflight.check_dtype(fp8_kv.resolve(64, None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 9))
    preflight.check_dtype(fp8_kv.resolve(64, None))
