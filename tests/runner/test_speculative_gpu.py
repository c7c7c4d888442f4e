"""Speculative decoding on the GPU (issue 38): verification steps replayed from token-count graphs equal the eager
forward for every captured size a (b, k) verification lands in; greedy tokens with drafts equal those without (fp32);
the acceptance counters add up."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.bench.decode_step import verify_batch
from nanoserve.runner.batch import DecodeBatch
from nanoserve.runner.dispatch import Kind
from tests.engine.test_speculative import LOOPING, NGRAM, SUFFIX
from tests.engine.test_speculative_draft_model import draft_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
OPTIONS = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256, max_num_seqs=16,
               num_kv_blocks=512, prefill_graph_sizes=[16, 32, 48, 64, 96, 128, 160])


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_tokens_and_counters_on_gpu(tiny_model_dirs, spec):
    path = str(tiny_model_dirs["qwen3"])
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = LOOPING * 3
    base = [o.token_ids for o in LLM(path, **OPTIONS).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, speculative_config=spec, **OPTIONS)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == base
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == base  # (suffix: cached outputs)
    stats = llm.engine.stats
    assert stats.spec_accepted_tokens > 0 and stats.prefill_steps_graph > 0
    assert stats.spec_accepted_tokens == sum(stats.spec_accepted_per_position) <= stats.spec_draft_tokens
    assert stats.generation_tokens == 2 * sum(len(t) for t in base)


def test_constrained_rows_verify_under_their_masks_on_gpu(tiny_model_dirs):
    """Structured outputs beside n-gram drafts, with the fused sampler's static bitmask covering every verified row:
    the greedy tokens of decoding without speculation, and the constrained sequence verified drafts."""
    from tests.engine.test_speculative_structured import GREEDY, PROMPTS

    path = str(tiny_model_dirs["qwen3"])
    base = [o.token_ids for o in LLM(path, **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(path, speculative_config=NGRAM, **OPTIONS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == base
    assert llm.engine.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["self", "noisy"])
def test_draft_model_in_decode_graphs(drafts, draft):
    """A draft model proposing inside the decode graphs (and mirroring the token-count graphs' steps): the tokens
    without speculation; drafting for itself, (nearly) every draft accepted (fp32)."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = LOOPING  # (3 sequences and 4 drafts each fit one 16-row decode batch; 9 would leave no room for drafts)
    base = [o.token_ids for o in LLM(drafts["target"], **OPTIONS).generate(prompts, params, use_tqdm=False)]
    # adaptive off: with measured step curves the plan may find a draft as large as the target not worth running
    llm = LLM(drafts["target"], speculative_config={**draft_spec(drafts[draft]), "adaptive": False}, **OPTIONS)
    for _ in range(2):  # (the second time over prefix-cache hits)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == base
    stats = llm.engine.stats
    assert stats.decode_steps_graph > 0 and stats.decode_steps_eager == 0 and stats.prefill_steps_graph > 0
    graphs = llm.engine.core.runner.graphs  # every verification proposes: no plain verification graphs
    assert Kind.VERIFY not in graphs.runners and graphs.sizes(Kind.DRAFT) == graphs.sizes(Kind.DECODE)
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens, (stats.spec_num_drafts, stats.spec_draft_tokens)
    if draft == "self":  # (the draft's steps and the verification run different kernels: a near-tie may differ)
        assert stats.spec_accepted_tokens >= 0.95 * stats.spec_draft_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verification_replay_equals_eager(tiny_model_dirs, dtype):
    """Every (b, k) verification batch through its graph (decode rows up to max_num_seqs, else a token-count graph)
    gives the eager forward's logits and tokens."""
    llm = LLM(str(tiny_model_dirs["llama"]), speculative_config={**NGRAM, "num_speculative_tokens": 8},
              **{**OPTIONS, "dtype": dtype})
    runner = llm.engine.core.runner
    for b in (1, 3, 8, 16):
        for k in (1, 4, 8):
            batch = verify_batch(runner, b, 40, k, draft_id=7)
            graph, eager = (_decode_pair if isinstance(batch, DecodeBatch) else _token_pair)(runner, batch)
            err = ((graph - eager).abs().max() / eager.abs().max()).item()
            assert err < (1e-5 if dtype == "float32" else 2e-2), (b, k, err)
            if dtype == "float32":
                assert torch.equal(graph.argmax(-1), eager.argmax(-1))
            if isinstance(batch, DecodeBatch):  # a sequence's rows read as one attention group == row by row
                fwd = runner.buffers.decode_forward
                assert fwd.seq_rows == 9
                n = batch.size  # (b sequences of k + 1 rows)
                fwd.load(batch, n)
                per_row = fwd(n, runner.kv.blocks_for(int(batch.context_lens.max())), verify=False).float()
                err = ((per_row - eager).abs().max() / eager.abs().max()).item()
                assert err < (1e-5 if dtype == "float32" else 2e-2), (b, k, err)


def _decode_pair(runner, batch):
    """A verification's rows through their graph (Kind.VERIFY: grouped by sequence) and eagerly."""
    fwd, b = runner.buffers.decode_forward, batch.size
    rows = runner.graphs.route(Kind.VERIFY, b)
    assert rows is not None and rows == runner.graphs.route(Kind.DECODE, b), b  # (the same sizes)
    fwd.load(batch, rows)
    graph = runner.graphs.replay(Kind.VERIFY, rows)[:b].float().clone()
    fwd.load(batch, b)
    return graph, fwd(b, runner.kv.blocks_for(int(batch.context_lens.max())), verify=True).float()


def _token_pair(runner, batch):
    fwd = runner.buffers.token_forward
    arrays = fwd.arrays(batch)
    tokens = runner.graphs.route(Kind.TOKENS, batch.num_tokens, fwd.inputs.fits(batch, arrays[1]))
    assert tokens is not None, batch.num_tokens
    tail = fwd.load(arrays, tokens)
    hidden, positions = runner.graphs.replay(Kind.TOKENS, tokens), fwd.inputs.views(tokens).positions
    graph = fwd.sample_logits(hidden, tail, batch, positions).logits.float().clone()
    return graph, fwd(batch).logits.float()


def test_plain_steps_replay_row_by_row_graphs(tiny_model_dirs, monkeypatch):
    """A speculating engine captures its decode sizes twice: plain steps replay Kind.DECODE (rows read one by one,
    the narrow query tile of an engine without speculation) and verifications Kind.VERIFY (a sequence's rows one
    attention group); each gives the eager forward's tokens."""
    from nanoserve.bench.decode_step import sampled_decode_batch
    from nanoserve.runner.cuda_graph import GraphRunner

    llm = LLM(str(tiny_model_dirs["llama"]), speculative_config=NGRAM, **OPTIONS)
    runner = llm.engine.core.runner
    assert runner.graphs.sizes(Kind.VERIFY) == runner.graphs.sizes(Kind.DECODE)
    replays = []
    for kind in (Kind.DECODE, Kind.VERIFY):
        gr = runner.graphs.runners[kind]
        monkeypatch.setattr(gr, "replay", lambda rows, _gr=gr, _k=kind: replays.append(_k) or
                            GraphRunner.replay(_gr, rows))
    state = runner.buffers.state
    tensors = (state.last_tokens, state.drafting.history, state.drafting.hist_len)
    for make, kind in ((lambda: sampled_decode_batch(runner, 3, 40), Kind.DECODE),
                       (lambda: verify_batch(runner, 2, 40, NGRAM["num_speculative_tokens"], draft_id=7), Kind.VERIFY)):
        before = [t.clone() for t in tensors]
        replays.clear()
        graph = runner.execute(make()).result().token_ids
        assert replays == [kind]
        for t, saved in zip(tensors, before):  # (the step's input tokens are the slots' last ones)
            t.copy_(saved)
        eager = runner.graphs.runners.pop(kind)
        try:
            assert runner.execute(make()).result().token_ids == graph, kind
        finally:
            runner.graphs.runners[kind] = eager
    llm.close()


def test_verification_curve_measured_at_start_up(tiny_model_dirs):
    """With planned graphs, start-up times the decode graphs over rows grouped by sequence (Probes.load_verify), and
    the draft plan prices a verification between that curve and the plain one."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=NGRAM, device="cuda", dtype="float32",
              max_model_len=256, max_num_seqs=16, num_kv_blocks=512)
    info = llm.engine.core.info
    assert info.step_curve is not None and info.verify_curve is not None
    assert max(info.verify_curve.rows) == 16 and min(info.verify_curve.ms) > 0
    cost = llm.engine.core._speculator._costs.verify
    rows = np.arange(1, 17)
    assert np.allclose(cost.grouped(rows), info.verify_curve(rows))
    assert cost.group == 1 + NGRAM["num_speculative_tokens"]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in LLM(str(tiny_model_dirs["qwen3"]), device="cuda", dtype="float32", max_model_len=256,
                                     max_num_seqs=16, num_kv_blocks=512).generate(LOOPING, params, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(LOOPING, params, use_tqdm=False)] == base


def test_verification_sampler_graph_equals_eager(tiny_model_dirs):
    """A verification after a decode graph samples, stores its accepted runs (last tokens, device histories) and
    packs its words in one replay (Kind.SAMPLE_VERIFY): the same tokens, drafts and device state as the eager
    sampler's."""
    llm = LLM(str(tiny_model_dirs["llama"]), speculative_config=NGRAM, **OPTIONS)
    runner = llm.engine.core.runner
    state = runner.buffers.state
    tensors = (state.last_tokens, state.drafting.history, state.drafting.hist_len)
    assert Kind.SAMPLE_VERIFY in runner.graphs.runners
    for b in (1, 3):  # (3 × 5 rows: one 16-row decode batch)
        batch = verify_batch(runner, b, 40, NGRAM["num_speculative_tokens"], draft_id=7)
        assert isinstance(batch, DecodeBatch)
        before = [t.clone() for t in tensors]
        out = []
        for graphs in (True, False):
            for t, saved in zip(tensors, before):
                t.copy_(saved)
            verify_graphs = runner.graphs.runners.pop(Kind.SAMPLE_VERIFY)
            if graphs:
                runner.graphs.runners[Kind.SAMPLE_VERIFY] = verify_graphs
            try:
                result = runner.execute(batch).result()
            finally:
                runner.graphs.runners[Kind.SAMPLE_VERIFY] = verify_graphs
            out.append((result.token_ids, result.draft_ids, [t.clone() for t in tensors]))
        (tokens, drafts, after), (eager_tokens, eager_drafts, eager_after) = out
        assert tokens == eager_tokens and drafts == eager_drafts == ([7] * 4 + [-1]) * b
        for got, want in zip(after, eager_after):  # (the dummy slot's last token is any padded row's)
            assert torch.equal(got[:-1], want[:-1])
        assert not all(torch.equal(a, b) for a, b in zip(after, before))  # (something was stored)
