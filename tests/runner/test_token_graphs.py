"""Token-count graphs for prompt / mixed steps (CPU): the static inputs' layout and padding, size planning,
config, and greedy tokens equal to transformers (fp32) with every prompt / mixed step run through the graph
path's eager twin (the same padded static-buffer forward the CUDA graphs capture): prefill chunks with decode
rows riding along, prefix-cache hits, chunk continuations and preemption mid-prefill."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, PREFILL_GRAPH_MAX_TOKENS, EngineConfig, GraphSizes
from nanoserve.kernels.attention import prefill_work_capacity
from nanoserve.runner.batch import BlockUpdates, PrefillBatch
from nanoserve.runner.startup.bucket_plan import StepCurve
from nanoserve.runner.startup.graphs import plan_tokens
from nanoserve.runner.inputs import PersistentState, TokenInputs, token_values
from tests.engine.churn import check_blocks
from tests.engine.test_engine import GREEDY, hf_greedy, prompts_of_lengths

SIZES = [4, 8, 12, 16]
OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=16, prefill_graph_sizes=SIZES)


def _graphed_only(llm) -> None:
    runner = llm.engine.core.runner
    assert list(runner.info.token_graph_sizes) == SIZES
    assert runner.counters.prefill_steps_graph > 0 and runner.counters.prefill_steps_eager == 0


def test_static_token_inputs_pad_tokens_sequences_and_work():
    state = PersistentState(max_num_seqs=4, max_blocks=4, dummy_block=50, device=torch.device("cpu"))
    inputs = TokenInputs(max_tokens=16, max_seqs=4, q_per_tile=2, state=state, dummy_kv_slot=200,
                         device=torch.device("cpu"))
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    # slot 2: a decode row (id -1) at position 9; slot 0: a 3-token chunk after 4 cached tokens
    batch = PrefillBatch(i32(2, 0), i32(9, 4), i32(1, 3), i32(-1, 11, 12, 13), i32(41, 16, 17, 18),
                         BlockUpdates(i32(0), i32(1), i32(4)), i32(0, 1), None, 3)
    address = inputs.device_buf.data_ptr()
    static, variable = token_values(batch, 2)
    assert inputs.fits(batch, variable)
    tail = inputs.load(static, variable, 8)
    v = inputs.views(8)
    assert v.ids.tolist() == [-1, 11, 12, 13, 0, 0, 0, 0] and v.positions.tolist() == [9, 4, 5, 6, 0, 0, 0, 0]
    assert v.slot_mapping.tolist() == [41, 16, 17, 18] + [200] * 4  # padded tokens write only the dummy block
    assert v.token_slots.tolist() == [2, 0, 0, 0] + [4] * 4 and v.slots.tolist() == [2, 0, 4, 4]
    assert v.context_lens.tolist() == [10, 7, 0, 0] and v.cu_seqlens_q.tolist() == [0, 1, 4, 4, 4]
    capacity = prefill_work_capacity(8, 4, 2)
    assert v.work_seq.tolist() == [0, 1, 1] + [-1] * (capacity - 3)  # tiles reading the most keys first
    assert v.work_start.tolist() == [0, 2, 0] + [-1] * (capacity - 3)
    rows, sampled_slots, us, uc, ub = (t.tolist() for t in (tail.sample_token_rows, tail.sampled_slots,
                                                              tail.update_slots, tail.update_cols, tail.update_ids))
    assert rows == [0, 3] and sampled_slots == [2, 0] and (us, uc, ub) == ([0], [1], [4])
    assert inputs.device_buf.data_ptr() == address and inputs.views(8) is v


def test_token_sizes_are_planned_from_the_curve_within_budgets():
    curve = StepCurve.fit({16: 1.0, 256: 1.2, 1024: 3.0, 2048: 6.0}, capture_seconds={2048: 0.1})
    sizes = plan_tokens(curve, 2048, capture_budget_s=1.0, pool_budget_bytes=2**30)
    assert sizes[-1] == 2048 and all(s % 16 == 0 for s in sizes) and 2 <= len(sizes) <= 13
    assert {16, 256, 1024} <= set(sizes)  # the measured probes are kept: captured already, in the shared pool
    assert plan_tokens(curve, 2048, capture_budget_s=0.05, pool_budget_bytes=2**30) == [2048]  # over budget


def test_prefill_graph_sizes_config():
    assert EngineConfig("m", prefill_graph_sizes=["off"]).prefill_graph_sizes == "off"
    assert EngineConfig("m", prefill_graph_sizes=["64", "16", "64"]).prefill_graph_sizes == [16, 64]
    for bad in (["sometimes"], [0], [1.5]):
        with pytest.raises(ValueError, match="prefill_graph_sizes"):
            EngineConfig("m", prefill_graph_sizes=bad)
    with pytest.raises(ValueError, match="exceed max_num_batched_tokens"):
        EngineConfig("m", device="cpu", prefill_graph_sizes=[64], max_num_batched_tokens=32).resolve(4096, None)
    cpu = EngineConfig("m", device="cpu").resolve(4096, None)
    assert cpu.prefill_graph_sizes == GraphSizes() and not cpu.prefill_graph_sizes  # "auto" needs CUDA
    twin = EngineConfig("m", device="cpu", prefill_graph_sizes=[8, 16]).resolve(4096, None)
    assert twin.prefill_graph_sizes == GraphSizes((8, 16), False, 16)
    assert twin.resolve(4096, None) == twin  # a resolved config resolves to itself
    # "auto" on a GPU (the token-count part of resolve()): planned, up to the budget, 2048 tokens, max_num_seqs rows
    assert EngineConfig("m")._token_graphs(True, 512, 4096) == GraphSizes((), True, 512)
    assert EngineConfig("m")._token_graphs(True, 8192, 4096) == GraphSizes((), True, PREFILL_GRAPH_MAX_TOKENS)
    assert EngineConfig("m", max_num_seqs=2)._token_graphs(True, 8192, 100) == GraphSizes((), True, 200)
    assert cpu.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_steps_through_the_graph_path_match_transformers(arch, tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs[arch]), **OPTIONS)
    prompts = prompts_of_lengths([5, 16, 31, 60], llm.engine.vocab_size, seed=11)  # 1, 1, 2 and 4 chunks
    expected = hf_greedy(tiny_model_dirs[arch], prompts, 12)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats.mixed_steps >= 7
    _graphed_only(llm)


def test_prefix_hits_and_decode_rows_through_the_graph_path(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    llm = LLM(str(path), **OPTIONS)
    engine = llm.engine
    shared = prompts_of_lengths([41], engine.vocab_size, seed=5)[0]
    prompts = [shared + [7, 8, 9], shared + [10] * 20, shared, [5, 6, 7]]
    engine.add_request("3", prompts[3], SamplingParams(max_tokens=30, **GREEDY), stream=False)
    for _ in range(3):
        engine.step()  # the short request decodes while the long ones arrive, then rides along their chunks
    for i, p in enumerate(prompts[:3]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, **GREEDY), stream=False)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step())
        check_blocks(engine)
    assert engine.stats.prefix_cache_hit_tokens >= 40 and engine.core.runner.counters.padding_tokens > 0
    expected = hf_greedy(path, prompts[:3], 8) + hf_greedy(path, prompts[3:], 30)
    assert [done[str(i)] for i in range(4)] == expected
    _graphed_only(llm)


def test_preemption_mid_prefill_through_the_graph_path(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    prompts = prompts_of_lengths([50, 45, 60, 38, 52], 500, seed=9)
    llm = LLM(str(path), num_kv_blocks=40, enable_prefix_caching=False, **OPTIONS)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, **GREEDY), stream=False)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.token_ids) for o in engine.step())
        check_blocks(engine)
    assert engine.stats.preemptions > 0
    assert [done[str(i)] for i in range(len(prompts))] == hf_greedy(path, prompts, 20)
    _graphed_only(llm)


# ---------------------------------------------------------------------------------------- GPU
GPU_OPTIONS = dict(device="cuda", max_model_len=512, max_num_seqs=16, num_kv_blocks=1024, max_num_batched_tokens=64,
                   show_progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "auto"), ("qwen3", "auto"), ("qwen3", "fp8")])
def test_graphed_prompt_steps_equal_eager_ones(arch, kv_cache_dtype, tiny_model_dirs):
    """fp32 (both paths attend through the paged kernel): the same greedy tokens with the token-count graphs as
    without, over fresh prompts, shared prefixes, chunk continuations and decode rows riding along; with an fp8 KV
    cache too."""
    path = str(tiny_model_dirs[arch])
    options = dict(GPU_OPTIONS, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    graphs = LLM(path, prefill_graph_sizes=[16, 32, 48, 64], **options)
    eager = LLM(path, prefill_graph_sizes="off", **options)
    shared = prompts_of_lengths([37], graphs.engine.vocab_size, seed=3)[0]
    prompts = prompts_of_lengths([3, 17, 70, 150, 9, 33], graphs.engine.vocab_size, seed=4)
    prompts += [shared + p[:5] for p in prompts]
    params = SamplingParams(max_tokens=24, **GREEDY)
    got = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert got == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    r = graphs.engine.core.runner
    assert r.counters.prefill_steps_graph > 0 and r.counters.padding_tokens > 0 and eager.engine.core.runner.counters.prefill_steps_graph == 0


@pytest.mark.gpu
def test_auto_token_sizes_are_planned_and_checked(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), dtype="bfloat16", **dict(GPU_OPTIONS, max_num_batched_tokens=512))
    sizes = llm.engine.core.runner.info.token_graph_sizes
    assert sizes[-1] == 512 and all(s % 16 == 0 for s in sizes) and llm.engine.core.runner.info.token_curve is not None
    outs = llm.generate([[5] * n for n in (10, 100, 300)], SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(len(o.token_ids) == 4 for o in outs) and llm.engine.stats.prefill_steps_graph > 0


def test_step_records_are_laid_out_from_their_fields():
    """Every region of a record starts 16-byte aligned, in field order, and an eager step's records read back by name
    what was packed (no code slices the buffer by position)."""
    import dataclasses

    from nanoserve.runner.inputs import ALIGN_WORDS, StepPacker, StepTail, TokenViews

    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    batch = PrefillBatch(i32(2, 0), i32(9, 4), i32(1, 3), i32(-1, 11, 12, 13), i32(41, 16, 17, 18),
                         BlockUpdates(i32(0), i32(1), i32(4)), i32(0, 1), None, 3)
    static, tail = token_values(batch, 2)
    views, tail_views = StepPacker(torch.device("cpu"), words=8).pack(static, tail)  # (grows to fit)
    for record, values in ((views, static), (tail_views, tail)):
        for f in dataclasses.fields(record):
            view = getattr(record, f.name)
            assert view.tolist() == pytest.approx(np.asarray(values[f.name]).tolist()), f.name
            assert view.storage_offset() % ALIGN_WORDS == 0, f.name
    starts = [getattr(views, f.name).storage_offset() for f in dataclasses.fields(TokenViews)]
    assert starts == sorted(starts) and tail_views.sample_token_rows.storage_offset() > starts[-1]
    assert {f.name for f in dataclasses.fields(StepTail)} >= {"update_slots", "update_cols", "update_ids"}
