"""benchmarks/kv_quality_variants.py's attention on a tiny random Llama (transformers' own classes, fp32): the bf16
variant is transformers' eager attention bit for bit, the recent-window and block-window selects reach both of their
ends (a window over the whole sequence is bf16, an empty one is e4m3-token), and the Hadamard rotation alone changes
nothing but rounding."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import kv_quality_variants as kvq  # noqa: E402
from nanoserve.tiny import make_tiny_model  # noqa: E402

SEQ = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    kvq.register()
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")
    return {impl: AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                       attn_implementation=impl).eval()
            for impl in ("eager", kvq.ATTENTION)}


@torch.no_grad()
def _logits(model, variant: kvq.Variant | None = None) -> torch.Tensor:
    ids = torch.randint(5, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with kvq.variant(variant or kvq.VARIANTS["bf16"]):
        return model(input_ids=ids).logits


def test_bf16_variant_is_transformers_eager(models):
    assert torch.equal(_logits(models[kvq.ATTENTION]), _logits(models["eager"]))


def test_recent_window_ends_are_bf16_and_e4m3(models):
    model = models[kvq.ATTENTION]
    e4m3 = _logits(model, kvq.VARIANTS["e4m3-token"])
    assert not torch.equal(e4m3, _logits(model))  # the round trip does change the logits
    assert torch.equal(_logits(model, kvq.Variant(kvq.E4M3, recent=SEQ)), _logits(model))
    assert torch.equal(_logits(model, kvq.Variant(kvq.E4M3, recent=0)), e4m3)


def test_block_window_ends_and_rotation(models):
    model = models[kvq.ATTENTION]
    exact, e4m3 = _logits(model), _logits(model, kvq.VARIANTS["e4m3-token"])
    assert torch.equal(_logits(model, kvq.Variant(kvq.E4M3, blocks=SEQ)), exact)
    assert torch.equal(_logits(model, kvq.Variant(kvq.E4M3, blocks=0)), e4m3)
    h = kvq.hadamard(8, torch.float32)
    assert torch.allclose(h @ h, torch.eye(8), atol=1e-6)
    assert torch.allclose(_logits(model, kvq.Variant(rotate=True)), exact, atol=1e-4)
