"""A verification's sample as its graph records it (Sampler.verify_forward, Kind.SAMPLE_VERIFY) against the eager
sampler on the same step: the same tokens and drafts read back, the same last tokens and device histories, and the
bucket's padded rows store nothing (CPU: the sample and store kernels under the Triton interpreter, the graph's
function run as its eager twin)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.runner.batch import disjoint_verify_batch
from nanoserve.runner.inputs import DecodeInputs, PersistentState, decode_values
from nanoserve.runner.sampler import Sampler
from nanoserve.runner.speculative import DraftState, VerifyRows
from nanoserve.bench.decode_step import greedy_sampling

SEQS, BLOCK, VOCAB, GROUP = 8, 4, 50, 3


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("record", [False, True])
@pytest.mark.usefixtures("force_triton")
def test_verification_sample_graph_equals_eager(record):
    cpu = torch.device("cpu")
    state = PersistentState(SEQS, 16, 63, cpu)
    inputs = DecodeInputs(16, state, 63 * BLOCK, cpu)
    drafting = DraftState(SEQS + 1, 64, 16, BLOCK, GROUP - 1, 1, 2, cpu) if record else None
    batch, _ = disjoint_verify_batch(7, GROUP, 10, BLOCK, 60)  # 3 sequences of 3, 3 and 1 rows; a bucket of 8
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0))
    best = logits[:7].argmax(-1).int().numpy()
    # drafts: the first sequence's both accepted, the second's first rejected, the third has none
    batch.draft_ids = np.array([best[0], best[1], -1, (best[3] + 1) % VOCAB, best[4], -1, -1], np.int32)
    batch.sampling = greedy_sampling(batch.slots)
    inputs.load(decode_values(batch), 8)
    views = inputs.views(8)
    tensors = [state.last_tokens] + ([drafting.history, drafting.hist_len] if record else [])
    initial = [t.clone() for t in tensors]
    out = []
    for graph in (True, False):
        for t, saved in zip(tensors, initial):
            t.copy_(saved)
        sampler = Sampler(16, cpu)
        verify = VerifyRows(views.draft_ids[:7], views.group_back[:7])
        params = views.sampling(7)
        slots, positions = views.slots[:7], views.positions[:7]
        rec = None if drafting is None else functools.partial(drafting.record_samples, slots=slots,
                                                              positions=positions, last_tokens=state.last_tokens)
        replay = None
        if graph:
            replay = functools.partial(sampler.verify_forward(logits, inputs.views, state.last_tokens, drafting), 8)
        handle = sampler(logits[:7], batch.sampling, params, state.last_tokens, slots, replay, verify, rec)
        result = handle.result()
        out.append((result.token_ids, result.draft_ids, [t.clone() for t in tensors]))
    (tokens, drafts, after), (eager_tokens, eager_drafts, eager_after) = out
    assert tokens == eager_tokens == best.tolist() and drafts == eager_drafts == batch.draft_ids.tolist()
    for got, want in zip(after, eager_after):  # (the dummy slot's last token is any row's: a padded input)
        assert torch.equal(got[:SEQS], want[:SEQS])
    assert state.last_tokens[:3].tolist() == [best[2], best[3], best[6]]  # each sequence's run ends there
    if record:
        assert drafting.hist_len[:3].tolist() == [11, 9, 11]  # (its ending row's position + 2)
        assert drafting.hist_len[SEQS] == 0  # the dummy slot, the padded rows' slot, keeps no tokens
