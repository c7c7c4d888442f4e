"""GraphRunner: bucket choice and padding (CPU), capture/replay invariants (GPU)."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.bench.decode_step import decode_batch, run_decode_step
from nanoserve.config import EngineConfig, default_capture_sizes
from nanoserve.kernels.step_inputs import prepare_decode
from nanoserve.runner.batch import DecodeBatch, SamplingBatch
from nanoserve.runner.cuda_graph import GraphRunner
from nanoserve.runner.dispatch import GraphTable, Kind
from nanoserve.runner.inputs import DecodeInputs, PersistentState, decode_values



def test_default_capture_sizes_are_powers_of_two_plus_max():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(256)[-3:] == [64, 128, 256]
    resolved = EngineConfig("m", max_num_seqs=256, device="cpu").resolve(4096, None)
    assert not resolved.cudagraph_capture_sizes and resolved.max_model_len == 4096  # no graphs on CPU


@pytest.mark.parametrize("sizes", [[0, 1], [-2], [1, 2.5], [1, 64], [True]])
def test_capture_sizes_are_validated(sizes):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineConfig("m", max_num_seqs=32, cudagraph_capture_sizes=sizes)


def test_custom_capture_sizes_are_sorted_and_deduplicated():
    assert EngineConfig("m", max_num_seqs=32, cudagraph_capture_sizes=[8, 1, 8, 3]).cudagraph_capture_sizes == [1, 3, 8]


def test_the_table_routes_each_step_to_the_smallest_captured_size_at_least_its_own():
    table, forward = GraphTable(), lambda n: torch.zeros(n)
    decode, sample = (GraphRunner(forward, lambda n: None, record=False) for _ in range(2))
    decode.capture([1, 2, 4, 8, 16, 24])
    sample.capture([1, 2, 4, 8, 16, 24])
    table.add(Kind.DECODE, decode)
    table.add(Kind.SAMPLE, sample)
    route = lambda b: table.route(Kind.DECODE, b)  # noqa: E731
    assert [route(b) for b in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert route(25) is None  # eager fallback above the largest bucket
    assert table.route(Kind.SAMPLE, 8) == 8 and table.route(Kind.SAMPLE, 3) is None  # the decode bucket's own
    assert table.route(Kind.TOKENS, 8) is None and table.route(Kind.DECODE, 8, fits=False) is None
    assert list(table.entries()) == ([(Kind.DECODE, s) for s in decode.capture_sizes] +
                                     [(Kind.SAMPLE, s) for s in sample.capture_sizes])


def test_static_inputs_pad_rows_to_the_dummy_slot_and_block():
    state = PersistentState(max_num_seqs=8, max_blocks=4, dummy_block=99, device=torch.device("cpu"))
    inputs = DecodeInputs(max_rows=8, state=state, dummy_kv_slot=99 * 16, device=torch.device("cpu"))
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    f32 = lambda *v: np.array(v, np.float32)  # noqa: E731
    sampling = SamplingBatch(i32(2, 5, 0), f32(0.0, 0.7, 1.0), f32(1.0, 0.9, 1.0), i32(0, 5, 0), f32(0, 0, 0.1))
    batch = DecodeBatch(i32(2, 5, 0), i32(10, 20, 30), i32(17, 33, 50), i32(11, 21, 31), i32(-1, 1, -1),
                        i32(0, 7, 0), sampling)
    addresses = inputs.device_buf.data_ptr()
    inputs.load(decode_values(batch), rows=4)
    v = inputs.views(4)
    assert v.slots.tolist() == [2, 5, 0, 8] and v.positions.tolist() == [10, 20, 30, 0]  # slot 8: the dummy slot
    assert v.slot_mapping.tolist() == [17, 33, 50, 99 * 16]  # the padded row writes only to the dummy block
    assert v.context_lens.tolist() == [11, 21, 31, 1]
    assert v.new_block_cols.tolist() == [-1, 1, -1, -1] and v.new_block_ids.tolist() == [0, 7, 0, 0]
    assert v.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0, 0.0])
    assert v.top_k.tolist() == [0, 5, 0, 0] and v.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    ids, tables = prepare_decode(v.slots, v.new_block_cols, v.new_block_ids, state.last_tokens, state.block_tables)
    assert state.block_tables[5].tolist() == [99, 7, 99, 99] and state.block_tables[8].tolist() == [99] * 4
    assert tables.tolist() == [[99] * 4, [99, 7, 99, 99], [99] * 4, [99] * 4] and ids.tolist() == [0] * 4
    assert inputs.device_buf.data_ptr() == addresses  # views of one buffer, never reallocated
    assert inputs.views(2).slots.data_ptr() == addresses and inputs.views(4) is v


# ---------------------------------------------------------------------------------------- GPU
def _tiny_llm(path, **kw):
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, block_size=16, num_kv_blocks=512,
                cudagraph_capture_sizes="pow2",
                show_progress=False)
    opts.update(kw)
    return LLM(str(path), **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_every_bucket_replay_equals_eager(tiny_model_dirs, kv_cache_dtype):
    """Per batch size (padded ones too), the first decode step's greedy token and logprob (a graph replay of the
    bucket) equal an enforce_eager engine's on the same prompts of 257 tokens (with an fp8 KV cache too)."""
    path = tiny_model_dirs["qwen3"]
    graphs = _tiny_llm(path, kv_cache_dtype=kv_cache_dtype)
    eager = _tiny_llm(path, enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    gr = graphs.engine.core.runner.graphs.runners[Kind.DECODE]
    assert gr.capture_sizes == [1, 2, 4, 8, 16] and set(gr.graphs) == set(gr.capture_sizes)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)
    for b in (1, 2, 3, 5, 8, 11, 16):
        prompts = [[(7 * i + j) % 400 + 3 for j in range(257)] for i in range(b)]
        before = graphs.engine.stats.decode_steps_graph
        got = graphs.generate(prompts, params, use_tqdm=False)
        assert graphs.engine.stats.decode_steps_graph > before, b
        for g, e in zip(got, eager.generate(prompts, params, use_tqdm=False)):
            assert g.token_ids == e.token_ids, b
            step = g.token_ids[1]
            assert g.logprobs[1][step] == pytest.approx(e.logprobs[1][step], abs=1e-3), b


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_greedy_tokens_identical_to_eager_for_each_bucket_over_64_steps(tiny_model_dirs, kv_cache_dtype):
    path = tiny_model_dirs["llama"]
    graphs = _tiny_llm(path, kv_cache_dtype=kv_cache_dtype)
    eager = _tiny_llm(path, enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
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
def test_static_addresses_never_change(tiny_model_dirs):
    llm = _tiny_llm(tiny_model_dirs["qwen2"])
    runner = llm.engine.core.runner
    gr, buffers = runner.graphs.runners[Kind.DECODE], runner.buffers

    def addresses():
        return (buffers.decode_inputs.device_buf.data_ptr(), buffers.kv_cache.data_ptr(),
                buffers.state.block_tables.data_ptr(), buffers.state.last_tokens.data_ptr(),
                sorted(o.data_ptr() for o in gr.outputs.values()))

    before = addresses()
    for b in [1, 16, 3, 9, 2, 16, 1] * 20:
        run_decode_step(runner, decode_batch(runner, b, 64))
    llm.generate([[3, 4, 5]] * 5, SamplingParams(max_tokens=20), use_tqdm=False)
    assert addresses() == before


@pytest.mark.gpu
def test_padded_rows_never_touch_real_kv(tiny_model_dirs):
    llm = _tiny_llm(tiny_model_dirs["qwen3"])
    runner = llm.engine.core.runner
    llm.generate([[5] * 100, [6] * 50], SamplingParams(max_tokens=1), use_tqdm=False)
    cache, blocks = runner.buffers.kv_cache, runner.info.num_kv_blocks
    real = cache[:, :, :blocks].clone()
    batch = decode_batch(runner, 3, 40)  # bucket 4: one padded row
    batch.slot_mapping[:] = runner.buffers.dummy_block * runner.config.block_size  # real rows write only the dummy block
    run_decode_step(runner, batch)
    assert runner.counters.padding_rows >= 1
    assert torch.equal(cache[:, :, :blocks], real)


@pytest.mark.gpu
def test_churn_500_steps_graphs_and_async_match_eager_sync(tiny_model_dirs):
    """Requests join and leave at random (EOS, stop ids, max_tokens, aborts; seeded sampling too); batch sizes
    cross buckets, exceed the largest (eager) and drop to 1. Graphs + async scheduling == eager + synchronous."""
    from tests.engine.churn import run_churn

    path = tiny_model_dirs["qwen3"]
    fast = _tiny_llm(path, max_num_seqs=24, cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    slow = _tiny_llm(path, max_num_seqs=24, enforce_eager=True, async_scheduling=False)
    got, stats = run_churn(fast.engine, steps=500)
    want, _ = run_churn(slow.engine, steps=500)
    assert got == want
    assert stats.decode_steps_graph > 0 and stats.decode_steps_eager > 0  # both paths exercised


@pytest.mark.gpu
def test_sampler_graph_replay_equals_the_oracle(tiny_model_dirs, monkeypatch):
    """Per bucket (padded batches too), masked or not: a plain decode step replays its bucket's sampler graph, which
    draws what the numpy Philox oracle draws under the same noise key (greedy and sampled rows), stores the tokens in
    the slots' cells and advances the key."""
    from nanoserve.kernels.sampling import sample_tokens_ref

    llm = _tiny_llm(tiny_model_dirs["qwen3"])
    runner = llm.engine.core.runner
    sampler, sizes = runner.buffers.sampler, runner.graphs.sizes(Kind.DECODE)
    kinds = {False: Kind.SAMPLE, True: Kind.SAMPLE_MASKED}
    assert all(runner.graphs.sizes(kinds[masked]) == sizes for masked in (False, True))
    replays = []
    for masked in (False, True):
        gr = runner.graphs.runners[kinds[masked]]
        monkeypatch.setattr(gr, "replay", lambda rows, _gr=gr, _m=masked: replays.append((rows, _m)) or
                            GraphRunner.replay(_gr, rows))
    g = torch.Generator().manual_seed(0)
    words = -(-runner.info.vocab_size // 32)
    for b in (1, 3, 8, 11, 16):
        for masked in (False, True):
            batch = decode_batch(runner, b, 64)
            temperature = np.array([(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(b)], np.float32)
            ones, zeros = np.ones(b, np.float32), np.zeros(b, np.float32)
            batch.sampling = SamplingBatch(batch.slots, temperature, ones, zeros.astype(np.int32), zeros)
            if masked:
                bitmask = torch.randint(-2**31, 2**31 - 1, (b, words), generator=g, dtype=torch.int64).to(torch.int32)
                bitmask[0] = -1
                batch.sampling.grammar_rows, batch.sampling.grammar_bitmask = np.arange(b, dtype=np.int32), bitmask
            key = int(sampler._seed.item())
            before = len(replays)
            got = runner.execute(batch).result().token_ids
            logits = runner.buffers.decode_forward.static_logits[:b].float().cpu()
            want = sample_tokens_ref(logits, bitmask if masked else None, torch.from_numpy(temperature), key)
            assert got == want.tolist(), (b, masked)
            assert runner.buffers.state.last_tokens[torch.from_numpy(batch.slots).long().cuda()].tolist() == got
            assert int(sampler._seed.item()) == key + 1
            assert replays[before:] == [(runner.graphs.route(Kind.DECODE, b), masked)], (b, masked)
