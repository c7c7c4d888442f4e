"""The dense families against transformers (float32, CPU): Gemma 2 (sandwich norms, (1 + w) weights, GeGLU, soft-caps,
windows on alternate layers), Gemma 3 (q/k norms, local / global RoPE; also the text part of a multimodal
checkpoint), Mistral with and without its window, Phi-3 (fused checkpoint tensors, partial rotary), OLMo-2 (post-norms,
q/k norm over the whole projection); prompts longer than the window, prefix-cached prefill, decode across the window
edge; the spec each config gives; refusals."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from nanoserve.kernels import fused
from nanoserve.model.communicator import check_sharding
from nanoserve.model.layers import RMSNorm
from nanoserve.model_files import ModelSpec, load_hf_config
from nanoserve.tiny import TINY_WINDOW
from tests.conftest import FAMILIES
from nanoserve.model.loader import load_model
from tests.model.test_llama import TOL, PagedKV, _to, decode_batch, hf_logits, prefill_batch, random_seqs

MAX_LEN = 128  # the engine's max_model_len: within phi3_longrope's original_max_position_embeddings


def ours(model_dir, tp=None):
    return load_model(model_dir, load_hf_config(model_dir), torch.float32, "cpu", tp=tp, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def hf_families(tiny_family_dirs):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
            for name, d in tiny_family_dirs.items()}


@pytest.mark.parametrize("name", FAMILIES)
@torch.inference_mode()
def test_prefill_prefix_hits_and_decode_match_hf(name, tiny_family_dirs, hf_families):
    """Mixed-length prompts (some past the window) prefilled in one batch, two of them after a cached prefix whose
    end is not a block edge, then decode steps that slide the window over block edges."""
    model = ours(tiny_family_dirs[name])
    kv = PagedKV(model, num_blocks=96, block_size=4)
    prompt_lens, cached, num_decode = [1, 5, 13, 23], [0, 0, 6, 11], 6
    full = random_seqs([n + num_decode for n in prompt_lens], model.vocab_size, seed=3)
    refs = [hf_logits(hf_families[name], s) for s in full]
    tables: list[list[int]] = [[] for _ in full]
    warm = [s[:c] for s, c in zip(full, cached) if c]  # the cached prefixes' keys, stored by a first prefill
    warm_tables = [tables[i] for i, c in enumerate(cached) if c]
    model(*prefill_batch(kv, warm_tables, warm, [0] * len(warm)))
    ids, pos, meta = prefill_batch(kv, tables, [s[:n] for s, n in zip(full, prompt_lens)], cached)
    logits = model.compute_logits(model(ids, pos, meta))
    for i, rows in enumerate(logits.split([n - c for n, c in zip(prompt_lens, cached)])):
        torch.testing.assert_close(rows, refs[i][cached[i]: prompt_lens[i]], **TOL)
    for step in range(num_decode):
        positions = [n + step for n in prompt_lens]
        ids, pos, meta = decode_batch(kv, tables, [s[p] for s, p in zip(full, positions)], positions, pad_rows=1)
        logits = model.compute_logits(model(ids, pos, meta))
        for i, p in enumerate(positions):
            torch.testing.assert_close(logits[i], refs[i][p], **TOL)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_mm", "phi3", "mistral"])
def test_two_ranks_compute_the_one_rank_logits(name, tiny_family_dirs):
    """Windows, soft-caps, sandwich norms and Phi-3's fused tensors (each part split on its own) under tp=2."""
    from tests.model.test_parallel import on_ranks, prefill_and_decode

    d = tiny_family_dirs[name]
    want = prefill_and_decode(ours(d), steps=8)  # past the window
    got = on_ranks(2, lambda tp: prefill_and_decode(ours(d, tp), steps=8))
    for step, ref in enumerate(want):
        torch.testing.assert_close(got[0][step], ref, **TOL)
        assert torch.equal(got[0][step], got[1][step])


def test_the_spec_each_config_gives(tiny_family_dirs):
    gemma2 = ours(tiny_family_dirs["gemma2"])
    assert [a.sliding_window for a in gemma2.attention_layers()] == [TINY_WINDOW, None, TINY_WINDOW]
    assert {(a.logit_softcap, a.scale) for a in gemma2.attention_layers()} == {(20.0, 24 ** -0.5)}
    assert gemma2.spec.final_softcap == 30.0 and gemma2.model.embed_scale == 8.0
    assert gemma2.model.rotary_emb_local is None and gemma2.model.layers[0].mlp.activation == "gelu_tanh"
    gemma3 = ours(tiny_family_dirs["gemma3"]).model
    assert gemma3.local_layers == [True, False, True]  # sliding layers: the local base, unscaled
    assert gemma3.rotary_emb_local.cos_sin_cache[1, 0] != gemma3.rotary_emb.cos_sin_cache[1, 0]
    phi3 = ours(tiny_family_dirs["phi3"]).model
    assert phi3.rotary_emb.rotary_dim == 8 and phi3.rotary_emb.head_dim == 16
    olmo2 = ours(tiny_family_dirs["olmo2"]).model.layers[0]
    assert olmo2.norm_names == (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
    assert olmo2.self_attn.q_norm.weight.shape == (64,) and olmo2.self_attn.k_norm.weight.shape == (32,)
    assert {a.sliding_window for a in ours(tiny_family_dirs["mistral_nowindow"]).attention_layers()} == {None}


def test_the_window_every_layer_has(tiny_family_dirs):
    """The engine frees slid-out blocks only where every layer is windowed (engine/block_manager.py)."""
    names = ("mistral", "mistral_nowindow", "gemma2", "gemma3", "phi3")
    got = {n: ModelSpec.from_hf_config(load_hf_config(tiny_family_dirs[n])).uniform_window for n in names}
    assert got == {"mistral": TINY_WINDOW, "mistral_nowindow": None, "gemma2": None, "gemma3": None, "phi3": None}
    assert ModelSpec.from_hf_config(_config(tiny_family_dirs["mistral"], sliding_window=4096)).uniform_window is None


@torch.inference_mode()
def test_soft_caps_and_gemma_norm_offset_change_the_result(tiny_family_dirs):
    """The tiny Gemma 2's caps bite (so its parity with HF checks them); its norms hold 1 + w."""
    from safetensors.torch import load_file

    d = tiny_family_dirs["gemma2"]
    model = ours(d)
    stored = load_file(str(d / "model.safetensors"))["model.norm.weight"]
    torch.testing.assert_close(model.model.norm.weight, 1 + stored)
    kv = PagedKV(model, num_blocks=16, block_size=4)
    seq = random_seqs([12], model.vocab_size, seed=5)
    capped = model.compute_logits(model(*prefill_batch(kv, [[]], seq, [0])))
    assert capped.abs().max() < 30.0
    for attn in model.attention_layers():
        attn.logit_softcap = None
    uncapped = model.compute_logits(model(*prefill_batch(kv, [[]], seq, [0])))
    assert not torch.allclose(capped, uncapped, atol=1e-2)


def _config(d, **changes):
    config = load_hf_config(d)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_refusals_are_one_line(tiny_family_dirs):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: Olmo2ForCausalLM .* runs on one rank only"):
        check_sharding(ModelSpec.from_hf_config(load_hf_config(tiny_family_dirs["olmo2"])), 2)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        ModelSpec.from_hf_config(_config(tiny_family_dirs["gemma3"], use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        ModelSpec.from_hf_config(_config(tiny_family_dirs["gemma2"], layer_types=["chunked_attention"] * 3))
    spec = ModelSpec.from_hf_config(_config(tiny_family_dirs["mistral"], sliding_window=4096))
    assert spec.window(0) is None  # as long as the context: full attention


# -- Gemma's sandwich norms: each post-norm runs in the kernel of the pre-norm after it ----------------------------
def _decode_once(model, device="cpu"):
    """Prefill three sequences, then one decode step: (prefill logits, decode logits)."""
    kv = PagedKV(model, num_blocks=16, block_size=4, device=device)
    for attn in model.attention_layers():
        attn.k_cache, attn.v_cache = attn.k_cache.to(model.dtype), attn.v_cache.to(model.dtype)
    seqs = random_seqs([5, 2, 7], model.vocab_size, seed=8)
    tables: list[list[int]] = [[] for _ in seqs]
    ids, pos, meta = prefill_batch(kv, tables, seqs, [0] * len(seqs))
    prefill = model.compute_logits(model(ids.to(device), pos.to(device), _to(meta, device)))
    ids, pos, meta = decode_batch(kv, tables, [1, 2, 3], [len(s) for s in seqs])
    return prefill, model.compute_logits(model(ids.to(device), pos.to(device), _to(meta, device)))


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "llama"])
@torch.inference_mode()
def test_a_layer_runs_two_norm_kernels(name, tiny_family_dirs, tiny_model_dirs):
    """A decode step runs 2 · layers + 1 norm kernels (fused.rms_norm calls) whether the family has Gemma's four
    norms a layer or Llama's two: post_attention_layernorm runs in pre_feedforward_layernorm's kernel,
    post_feedforward_layernorm in the next layer's input_layernorm's (the last layer's: the final norm's)."""
    model = ours({**tiny_model_dirs, **tiny_family_dirs}[name])
    with mock.patch.object(fused, "rms_norm", wraps=fused.rms_norm) as calls:
        _decode_once(model)
    assert calls.call_count == 2 * (2 * model.num_layers + 1)  # the prefill's and the decode step's
    sandwich = model.model.layers[0].norm_names[1] is not None
    assert sum(c.kwargs.get("x_norm") is not None for c in calls.call_args_list) == (
        2 * 2 * model.num_layers if sandwich else 0)


def _two_calls(rms_norm):
    """fused.rms_norm as it ran before x_norm: an owed post-norm is a launch of its own."""
    def unfused(x, weight, eps, residual=None, quantize=False, x_norm=None):
        if x_norm is not None:
            x = rms_norm(x, *x_norm)
        return rms_norm(x, weight, eps, residual, quantize)
    return unfused


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_folded_post_norms_equal_their_own_launches_bit_for_bit(tiny_family_dirs, tmp_path):
    """bf16 on the GPU at Gemma-3-4B's width (2560: the norm kernels run apart from the GEMV, and every post-norm in
    the next pre-norm's): prefill and decode logits with the folded post-norms == with each post-norm a launch of its
    own, bit for bit."""
    config = _config(tiny_family_dirs["gemma3"], hidden_size=2560, intermediate_size=1024, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=256)
    model = load_model(tmp_path / "nowhere", config, torch.bfloat16, "cuda", load_format="dummy", max_model_len=MAX_LEN)
    g = torch.Generator().manual_seed(0)
    for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):  # dummy norms are 1: make each differ
        norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
    folded = _decode_once(model, "cuda")
    with mock.patch.object(fused, "rms_norm", _two_calls(fused.rms_norm)):
        unfolded = _decode_once(model, "cuda")
    for got, want in zip(folded, unfolded):
        assert torch.isfinite(want.float()).all() and torch.equal(got, want)
