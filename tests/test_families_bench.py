"""benchmarks/families.py's pure parts and the family byte counts its floors rest on (benchmarks/common.py).

The parameter counts are checked against transformers' own models of the tiny families (nanoserve.tiny), the text
model only for Gemma 3's multimodal checkpoint; the Llama twin and the windowless variant against the engine's
ModelSpec; main() without a GPU prints one line and exits 0.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common, families  # noqa: E402
from nanoserve.tiny import make_tiny_model  # noqa: E402

_VISION = ("vision_tower", "multi_modal_projector")


def _hf_text_params(model_dir: Path) -> int:
    """Parameters of transformers' model of the folder (meta device), the vision tower and projector left out."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        if config.model_type == "gemma3":
            model = transformers.Gemma3ForConditionalGeneration(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for name, p in model.named_parameters() if not any(v in name for v in _VISION))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gemma3_mm", "mistral", "phi3", "olmo2"])
def test_param_counts_match_transformers_for_the_families(tmp_path, arch):
    path = make_tiny_model(tmp_path / arch, arch)
    cfg = json.loads((path / "config.json").read_text())
    assert common.param_counts(cfg).total == _hf_text_params(path)


def test_tied_head_is_read_whole():
    """Gemma ties its 262k-row head to the embedding: a decode step reads it all, an untied embedding only rows."""
    gemma, mistral = (common.param_counts(common.model_config(n)) for n in ("gemma-3-4b", "mistral-7b"))
    assert gemma.lm_head == 0 and gemma.decode_read(1) == gemma.total == gemma.active
    assert 3.8e9 < gemma.total < 3.9e9  # Gemma 3 4B's text model
    assert mistral.decode_read(1) == mistral.total - mistral.embedding == mistral.active
    assert 7.2e9 < mistral.total < 7.3e9  # "7.24B"


@pytest.mark.parametrize("name", ["gemma-3-4b", "mistral-7b"])
def test_llama_twin_reads_the_same_bytes(name):
    cfg = common.model_config(name)
    twin = families.llama_twin(cfg)
    spec, own = common.model_spec(twin), common.model_spec(cfg)
    assert spec.architecture == "LlamaForCausalLM" and spec.layer_types == ("full_attention",) * own.num_layers
    assert spec.family == type(spec.family)() and spec.activation == "silu" and spec.final_softcap is None
    assert common.kv_bytes_per_token(twin) == common.kv_bytes_per_token(cfg)
    family, plain = common.param_counts(cfg), common.param_counts(twin)
    norms = own.num_layers * (2 * own.hidden_size + 2 * own.head_dim)  # Gemma's extra norms: sandwich + q/k
    assert 0 <= family.total - plain.total <= norms
    assert family.embedding == plain.embedding and family.lm_head == plain.lm_head
    assert (family.total == plain.total) == (name == "mistral-7b")


def test_without_windows_reads_no_window(tmp_path):
    from nanoserve.model_files import load_hf_config
    from nanoserve.model_spec import ModelSpec

    cfg = common.model_config("gemma-3-4b")
    spec = common.model_spec(cfg)
    assert spec.sliding_window == 1024 and spec.layer_types.count("full_attention") == 5  # every 6th of 34
    plain = families.without_windows(cfg)
    assert cfg == common.model_config("gemma-3-4b")  # the input is left alone
    loaded = ModelSpec.from_hf_config(load_hf_config(common.write_model_dir(plain, tmp_path)))
    assert loaded.sliding_window is None and set(loaded.layer_types) == {"full_attention"}
    assert loaded.num_layers == 34 and loaded.family == spec.family  # only the windows differ


def test_kv_bytes_read_counts_windows_on_local_layers_only():
    cfg = common.model_config("gemma-3-4b")
    per_layer_token = 2 * 4 * 256 * 2  # K and V, 4 KV heads of 256, bf16
    assert common.kv_bytes_per_token(cfg) == 34 * per_layer_token
    assert common.kv_bytes_read(cfg, 8192) == per_layer_token * (29 * 1024 + 5 * 8192)
    assert common.kv_bytes_read(cfg, 512) == 512 * common.kv_bytes_per_token(cfg)  # inside every window
    assert common.kv_bytes_read(families.without_windows(cfg), 8192) == 8192 * common.kv_bytes_per_token(cfg)
    mistral = common.model_config("mistral-7b")
    assert common.kv_bytes_read(mistral, 8192) == 4096 * common.kv_bytes_per_token(mistral)


def test_targets_read_off_a_report():
    step = lambda ms, floor=1.0: {"step_ms": ms, "floor_ms": floor}  # noqa: E731
    report = {"decode": {"1": step(1.2), "64": step(3.0)}, "twin_decode": {"1": step(1.0), "64": step(2.0)},
              "long_context": {"windowed": step(4.0), "no_windows": step(10.0)},
              "prompt_graphs": {"async-2048": {"prefill_steps_eager": 0}}}
    t = families.targets(report)
    assert t["twin_ratio_b1"] == {"value": pytest.approx(1.2), "limit": 1.15, "met": False}
    assert t["twin_ratio_b64"]["value"] == pytest.approx(1.5) and not t["twin_ratio_b64"]["met"]
    assert t["floor_ratio_b1"]["met"] and t["window_ratio"]["value"] == pytest.approx(0.4) and t["window_ratio"]["met"]
    assert t["eager_prompt_steps_le_2048"] == {"value": 0, "limit": 0, "met": True}
    assert families.targets({"decode": {"1": step(1.0)}}) == {"floor_ratio_b1": {"value": 1.0, "limit": 1.3,
                                                                                 "met": True}}


def test_main_without_cuda_prints_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert families.main(["all"]) == 0
    assert capsys.readouterr().out.strip() == "families.py needs a CUDA GPU"


def test_prompt_graphs_reports_each_variants_budget():
    stats = {"prefill_steps_eager": 3, "prefill_steps_graph": 40, "mixed_steps": 43}
    out = families.prompt_graphs({"variants": {"async": {"stats": stats}, "async-2048": {"error": "OOM"}}})
    assert out["async"] == dict(stats, budget=8192, largest_prompt=1024, graph_max_tokens=2048, error=None)
    assert out["async-2048"]["budget"] == 2048 and out["async-2048"]["prefill_steps_eager"] is None
