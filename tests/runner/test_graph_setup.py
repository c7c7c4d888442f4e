"""Graph start-up: the "auto" plan, the self-check, the batch histogram (CPU where possible, GPU otherwise)."""
from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig, GraphSizes
from nanoserve.runner.dispatch import Kind
from nanoserve.runner.startup.bucket_plan import BatchDistribution
from nanoserve.runner.startup.graphs import probe_sizes
from nanoserve.runner.startup.probes import Probes
from nanoserve.runner.startup.self_check import GraphCheckError, self_check


def test_capture_size_modes_are_validated():
    assert EngineConfig("m").cudagraph_capture_sizes == "auto"
    assert EngineConfig("m", cudagraph_capture_sizes=["pow2"]).cudagraph_capture_sizes == "pow2"  # the CLI's form
    assert EngineConfig("m", max_num_seqs=8, cudagraph_capture_sizes=["4", "1"]).cudagraph_capture_sizes == [1, 4]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineConfig("m", cudagraph_capture_sizes="powers")
    with pytest.raises(ValueError, match="cudagraph_capture_budget_s"):
        EngineConfig("m", cudagraph_capture_budget_s=0)
    resolved = EngineConfig("m", max_num_seqs=20, cudagraph_capture_sizes="pow2", device="cpu").resolve(512, None)
    assert not resolved.cudagraph_capture_sizes and resolved.cudagraph_capture_sizes.largest == 0  # CPU: no graphs
    # on a GPU: resolve() makes every mode concrete (the decode forward's part; the device is the caller's)
    config = EngineConfig("m", max_num_seqs=20, cudagraph_capture_sizes="pow2")
    assert config._decode_graphs() == GraphSizes((1, 2, 4, 8, 16, 20), False, 20)
    assert EngineConfig("m", max_num_seqs=20)._decode_graphs() == GraphSizes((), True, 20)  # "auto": planned


def test_probe_sizes_end_with_max_num_seqs():
    assert probe_sizes(256) == [1, 8, 32, 64, 128, 256]
    assert probe_sizes(20) == [1, 8, 20] and probe_sizes(1) == [1]


def test_batch_histogram_is_recorded_and_written_on_close(tiny_model_dirs, tmp_path):
    plan = tmp_path / "plan.json"
    with LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=128, max_num_seqs=8,
             cudagraph_plan=str(plan)) as llm:
        llm.generate([[3, 4, 5]] * 3, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    counts = BatchDistribution.load(plan).counts
    assert len(counts) == 8 and counts[2] >= 4 and counts.sum() == counts[2]  # every decode step had 3 rows


def _tiny_gpu_llm(path, **kw):
    opts = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=32, num_kv_blocks=1024,
                show_progress=False)
    return LLM(str(path), **dict(opts, **kw))


def _self_check(runner) -> dict:
    """The start-up self-check again, over the runner's graph table, on fresh probes."""
    probes = Probes(runner.buffers, runner.config, runner.kv, runner.info.num_kv_blocks, runner.info.vocab_size,
                    runner.rng, torch.Generator().manual_seed(1))
    return self_check(runner.graphs, runner.buffers, probes, runner.dtype)


@pytest.mark.gpu
def test_auto_plan_captures_within_budget_and_checks_every_size(tiny_model_dirs, tmp_path):
    llm = _tiny_gpu_llm(tiny_model_dirs["qwen3"], cudagraph_capture_budget_s=5.0)
    runner = llm.engine.core.runner
    gr = runner.graphs.runners[Kind.DECODE]
    assert gr.capture_sizes[-1] == 32 and runner.info.step_curve is not None
    assert gr.capture_seconds <= 5.0 + 1.0
    out = llm.generate([[5, 6, 7]] * 5, SamplingParams(max_tokens=8), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in out) and llm.engine.stats.decode_steps_graph > 0


@pytest.mark.gpu
def test_self_check_catches_a_replaced_static_buffer(tiny_model_dirs):
    llm = _tiny_gpu_llm(tiny_model_dirs["llama"], cudagraph_capture_sizes=[1, 4, 32])
    runner = llm.engine.core.runner
    worst = _self_check(runner)
    assert set(worst) == {Kind.DECODE, Kind.TOKENS, Kind.SAMPLE, Kind.SAMPLE_MASKED} and max(worst.values()) < 5e-2
    inputs = runner.buffers.decode_inputs
    captured = inputs.device_buf  # kept alive: the graphs go on reading it (freed, it would hold anything)
    inputs.device_buf = torch.zeros_like(captured)
    inputs._views.clear()
    with pytest.raises(GraphCheckError, match="rows does not reproduce the eager forward"):
        _self_check(runner)


@pytest.mark.gpu
def test_token_graph_self_check_catches_a_replaced_static_buffer(tiny_model_dirs):
    llm = _tiny_gpu_llm(tiny_model_dirs["qwen3"], prefill_graph_sizes=[16, 64, 256], dtype="bfloat16")
    runner = llm.engine.core.runner
    sizes = runner.graphs.sizes(Kind.TOKENS)
    assert sizes == [16, 64, 256] and _self_check(runner)[Kind.TOKENS] < 5e-2
    inputs = runner.buffers.token_forward.inputs
    captured = inputs.device_buf  # kept alive: the graphs go on reading it
    inputs.device_buf = torch.zeros_like(captured)
    inputs._views.clear()
    # only the size loaded last keeps valid (stale) inputs in the old buffer: the others would read its 256-token
    # layout at their own offsets, indices out of range
    runner.graphs.runners[Kind.TOKENS].drop([16, 64])
    with pytest.raises(GraphCheckError, match="graph of 256 tokens \\(a mixed step\\) does not reproduce"):
        _self_check(runner)
