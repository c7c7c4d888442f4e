"""The dense families against transformers (float32, CPU): Gemma 2 (sandwich norms, (1 + w) weights, GeGLU, soft-caps,
windows on alternate layers), Gemma 3 (q/k norms, local / global RoPE; also the text part of a multimodal
checkpoint), Mistral with and without its window, Phi-3 (fused checkpoint tensors, partial rotary), OLMo-2 (post-norms,
q/k norm over the whole projection); prompts longer than the window, prefix-cached prefill, decode across the window
edge; the spec each config gives; refusals."""
from __future__ import annotations

import pytest
import torch

from nanoserve.model.communicator import TensorParallel, check_sharding
from nanoserve.model_files import ModelSpec, load_hf_config
from nanoserve.tiny import TINY_WINDOW
from tests.conftest import FAMILIES
from nanoserve.model.loader import load_model
from tests.model.test_llama import TOL, PagedKV, decode_batch, hf_logits, prefill_batch, random_seqs

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
