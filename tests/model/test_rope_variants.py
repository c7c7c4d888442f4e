"""RoPE variants of the new dense families (model/layers.py's tables, model_files.rope_parameters) against
transformers: partial rotary (Phi-3 / Phi-4-mini) and LongRoPE with its one factor set fixed by the engine's max
length (short factors up to original_max_position_embeddings, long beyond)."""
import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from nanoserve.kernels import rotary_kv
from nanoserve.model.layers import RotaryEmbedding, rope_inv_freq
from nanoserve.rope_config import rope_parameters

ORIGINAL = 256  # original_max_position_embeddings of the test configs (Phi-3-128k: 4096)


def phi3_config(attention_factor=None, head_dim=128, partial=0.75):
    half = int(head_dim * partial) // 2
    scaling = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
               "long_factor": [1.0 + 0.9 * i for i in range(half)]}
    if attention_factor is not None:
        scaling["attention_factor"] = attention_factor
    return Phi3Config(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=32 * ORIGINAL,
                      original_max_position_embeddings=ORIGINAL, partial_rotary_factor=partial, rope_scaling=scaling)


@pytest.mark.parametrize("attention_factor", [None, 1.3])
@pytest.mark.parametrize("max_position,seq_len", [(ORIGINAL, None), (ORIGINAL + 1, ORIGINAL + 1), (8 * ORIGINAL, 4000)],
                         ids=["short", "long-just-past", "long"])
def test_longrope_frequencies_match_transformers(max_position, seq_len, attention_factor):
    """Short factors while the engine's max length is at most original_max_position_embeddings, long beyond; the
    attention factor HF's (from max_position_embeddings / original) or the config's, for both sets."""
    config = phi3_config(attention_factor)
    params = rope_parameters(config)
    assert params["rope_type"] == "longrope" and params["factor"] == 32.0
    inv_freq, scale = rope_inv_freq(96, params, max_position)
    ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=seq_len)
    torch.testing.assert_close(inv_freq, ref.float(), atol=0, rtol=1e-6)
    assert math.isclose(scale, ref_scale, rel_tol=1e-9)
    assert attention_factor is not None or math.isclose(scale, math.sqrt(1 + math.log(32) / math.log(ORIGINAL)))


@pytest.mark.parametrize("max_position", [ORIGINAL, 2 * ORIGINAL], ids=["short", "long"])
def test_longrope_table_matches_phi3_rotary_embedding(max_position):
    """The whole cos/sin table (96 of 128 dims) == Phi3RotaryEmbedding's at a sequence as long as the table, which
    is where HF switches to the same factor set."""
    config = phi3_config()
    table = RotaryEmbedding(128, max_position, rope_parameters(config), torch.float32, rotary_dim=96).cos_sin_cache
    positions = torch.arange(max_position)[None]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1), positions)
    assert rotary_kv.rotary_dim(table, 128) == 96
    torch.testing.assert_close(table[:, :96], cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(table[:, 144:], sin[0, :, 48:], rtol=1e-5, atol=1e-5)


def test_longrope_factors_must_fit_the_rotated_head():
    params = rope_parameters(phi3_config(partial=1.0))  # 64 factors: a 128-wide rotation, not the 96 asked here
    with pytest.raises(ValueError, match="short_factor has 64 values"):
        rope_inv_freq(96, params, ORIGINAL)


def test_rope_parameters_return_the_partial_rotary_factor():
    assert rope_parameters(Phi3Config(partial_rotary_factor=0.75))["partial_rotary_factor"] == 0.75
    assert rope_parameters(LlamaConfig())["partial_rotary_factor"] == 1.0
    rope = RotaryEmbedding(32, 8, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32, rotary_dim=24)
    assert rope.cos_sin_cache.shape == (8, 48) and rotary_kv.rotary_dim(rope.cos_sin_cache, 32) == 24
    with pytest.raises(ValueError, match="rotary_dim=7"):
        RotaryEmbedding(32, 8, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32, rotary_dim=7)
