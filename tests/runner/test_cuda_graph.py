"""GraphRunner: bucket choice and padding (CPU), capture/replay invariants (GPU)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig, default_capture_sizes
from nanoserve.runner.cuda_graph import DecodeBatch, GraphRunner, StaticDecodeInputs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_default_capture_sizes_are_powers_of_two_plus_max():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert EngineConfig("m", max_num_seqs=256).capture_sizes()[-3:] == [64, 128, 256]


@pytest.mark.parametrize("sizes", [[0, 1], [-2], [], [1, 2.5], [1, 64]])
def test_capture_sizes_are_validated(sizes):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineConfig("m", max_num_seqs=32, cudagraph_capture_sizes=sizes)


def test_custom_capture_sizes_are_sorted_and_deduplicated():
    assert EngineConfig("m", max_num_seqs=32, cudagraph_capture_sizes=[8, 1, 8, 3]).capture_sizes() == [1, 3, 8]


def test_bucket_is_the_smallest_captured_size_at_least_b():
    runner = GraphRunner.__new__(GraphRunner)
    runner.capture_sizes = [1, 2, 4, 8, 16, 24]
    assert [runner.bucket_for(b) for b in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert runner.bucket_for(25) is None  # eager fallback above the largest bucket


def test_static_inputs_pad_rows_to_the_dummy_block():
    inputs = StaticDecodeInputs(max_rows=8, max_blocks=4, dummy_block=99, block_size=16, device=torch.device("cpu"))
    batch = DecodeBatch(np.array([5, 6, 7], np.int32), np.array([10, 20, 30], np.int32),
                        np.array([17, 33, 50], np.int32), np.array([11, 21, 31], np.int32),
                        np.array([[1, 0], [2, 0], [3, 4]], np.int32))
    addresses = inputs.device_buf.data_ptr()
    inputs.load(batch, rows=4)
    ids, pos, meta = inputs.views(4)
    assert ids.tolist() == [5, 6, 7, 0] and pos.tolist() == [10, 20, 30, 0]
    assert meta.slot_mapping.tolist() == [17, 33, 50, 99 * 16]  # padded row writes only to the dummy block
    assert meta.context_lens.tolist() == [11, 21, 31, 1]
    assert meta.block_tables.tolist() == [[1, 0, 99, 99], [2, 0, 99, 99], [3, 4, 99, 99], [99, 99, 99, 99]]
    assert inputs.device_buf.data_ptr() == addresses  # views of one buffer, never reallocated
    small_ids, _, small_meta = inputs.views(2)
    assert small_ids.data_ptr() == addresses and small_meta.block_tables.shape == (2, 4)


# ---------------------------------------------------------------------------------------- GPU
def _tiny_llm(path, **kw):
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, block_size=16, num_kv_blocks=512,
                show_progress=False)
    opts.update(kw)
    return LLM(str(path), **opts)


@pytest.mark.gpu
@gpu
def test_every_bucket_replay_equals_eager(tiny_model_dirs):
    llm = _tiny_llm(tiny_model_dirs["qwen3"], dtype="bfloat16")
    runner = llm.engine.model_runner
    gr = runner.graph_runner
    assert gr.capture_sizes == [1, 2, 4, 8, 16] and set(gr.graphs) == set(gr.capture_sizes)
    # fill the cache with real context first so attention reads meaningful values
    llm.generate([[1 + i] * 300 for i in range(16)], SamplingParams(max_tokens=1), use_tqdm=False)
    for b in (1, 2, 3, 5, 8, 11, 16):
        batch = runner.dummy_decode_batch(b, 257)
        graph = runner.decode_logits(batch, use_graph=True).float().clone()
        eager = runner.decode_logits(batch, use_graph=False).float()
        torch.testing.assert_close(graph, eager, rtol=2e-2, atol=2e-2)
        assert torch.equal(graph.argmax(-1), eager.argmax(-1))


@pytest.mark.gpu
@gpu
def test_greedy_tokens_identical_to_eager_for_each_bucket_over_64_steps(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    graphs = _tiny_llm(path)
    eager = _tiny_llm(path, enforce_eager=True)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for b in (1, 2, 3, 4, 7, 8, 16):
        prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + 3 * i)] for i in range(b)]
        got = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
        want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        assert got == want, f"batch {b}"
    stats = graphs.engine.stats
    assert stats.decode_steps_graph > 0 and stats.decode_steps_eager == 0
    assert eager.engine.stats.decode_steps_graph == 0


@pytest.mark.gpu
@gpu
def test_static_addresses_never_change(tiny_model_dirs):
    llm = _tiny_llm(tiny_model_dirs["qwen2"])
    runner = llm.engine.model_runner
    gr = runner.graph_runner
    before = (runner.decode_inputs.device_buf.data_ptr(), gr.logits.data_ptr(), runner.kv_cache.data_ptr())
    for b in [1, 16, 3, 9, 2, 16, 1] * 20:
        runner.decode_logits(runner.dummy_decode_batch(b, 64))
    assert (runner.decode_inputs.device_buf.data_ptr(), gr.logits.data_ptr(), runner.kv_cache.data_ptr()) == before


@pytest.mark.gpu
@gpu
def test_padded_rows_never_touch_real_kv(tiny_model_dirs):
    llm = _tiny_llm(tiny_model_dirs["qwen3"])
    runner = llm.engine.model_runner
    llm.generate([[5] * 100, [6] * 50], SamplingParams(max_tokens=1), use_tqdm=False)
    real = runner.kv_cache[:, :, :runner.num_kv_blocks].clone()
    batch = runner.dummy_decode_batch(3, 40)  # bucket 4: one padded row
    batch.slot_mapping[:] = runner.dummy_block * runner.block_size  # real rows also write only to the dummy block
    runner.decode_logits(batch)
    assert runner.padding_rows >= 1
    assert torch.equal(runner.kv_cache[:, :, :runner.num_kv_blocks], real)


@pytest.mark.gpu
@gpu
def test_churn_500_steps_matches_enforce_eager(tiny_model_dirs):
    """Requests join and leave at random; batch sizes cross buckets, exceed the largest (eager) and drop to 1."""
    path = tiny_model_dirs["qwen3"]

    def run(enforce_eager: bool):
        llm = _tiny_llm(path, max_num_seqs=24, cudagraph_capture_sizes=[1, 2, 4, 8, 16], enforce_eager=enforce_eager)
        engine, rng = llm.engine, random.Random(0)
        finished, next_id, steps = {}, 0, 0
        while steps < 500:
            if rng.random() < 0.35 and next_id < 400:
                n = rng.choice([1, 1, 2, 6])
                for _ in range(n):
                    prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
                    engine.add_request(str(next_id), prompt,
                                       SamplingParams(max_tokens=rng.randrange(1, 60), temperature=0.0, ignore_eos=True))
                    next_id += 1
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
            steps += 1
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
        assert engine.block_manager.num_used_blocks == 0
        return finished, engine.stats

    got, stats = run(False)
    want, _ = run(True)
    assert got == want
    assert stats.decode_steps_graph > 0 and stats.decode_steps_eager > 0  # both paths exercised
