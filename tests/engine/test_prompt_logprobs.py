"""Prompt logprobs (what `echo` + `logprobs` shows) against transformers' own forward of the same tiny model,
through chunked prefill and preemption-free batching with other requests; logit_bias in the offline API."""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams

OPTS = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, show_progress=False)


@pytest.fixture(scope="module", params=["eager", "graph path"])
def llm(tiny_model_dirs, request):
    """Prompt / mixed steps eagerly, and through the token-count graphs' padded static forward (its eager twin)."""
    graphs = {"prefill_graph_sizes": [8, 16]} if request.param == "graph path" else {}
    with LLM(str(tiny_model_dirs["qwen3"]), **OPTS, **graphs) as llm:
        yield llm


def test_prompt_logprobs_match_transformers(llm, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    ids = list(range(5, 45))  # 40 tokens over three 16-token chunks
    plain, asked = llm.generate([[3, 4, 5, 6], ids], [SamplingParams(max_tokens=2, temperature=0),
                                                      SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)],
                                use_tqdm=False)
    assert plain.prompt_logprobs is None
    pl = asked.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] is None
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs["qwen3"]), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert pl[i][ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(3)
        assert set(top.indices.tolist()) <= set(pl[i]) and 3 <= len(pl[i]) <= 4


def test_a_repeated_prompt_still_gets_every_prompt_logprob(llm):
    ids = list(range(10, 60))
    first = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    again = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]  # cached prefix
    assert len(again.prompt_logprobs) == len(ids)
    assert [d[t] for d, t in zip(again.prompt_logprobs[1:], ids[1:])] == \
        pytest.approx([d[t] for d, t in zip(first.prompt_logprobs[1:], ids[1:])], abs=1e-5)


def test_logit_bias_forces_and_forbids(llm):
    forced = llm.generate(["hello"], SamplingParams(max_tokens=6, temperature=1.0, seed=0, ignore_eos=True,
                                                    logit_bias={7: 100}), use_tqdm=False)[0]
    assert forced.token_ids == [7] * 6
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = llm.generate(["hello"], greedy, use_tqdm=False)[0].token_ids
    steered = llm.generate(["hello"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                     logit_bias={t: -100 for t in base}), use_tqdm=False)[0].token_ids
    assert not set(steered) & set(base)


def test_logit_bias_is_validated_and_clamped():
    assert SamplingParams(logit_bias={3: 250, 4: -1e9}).logit_bias == {3: 100.0, 4: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="at most 300 tokens"):
        SamplingParams(logit_bias={i: 1 for i in range(301)})
    with pytest.raises(ValueError, match="logit_bias must be a map"):
        SamplingParams(logit_bias={-1: 1})
