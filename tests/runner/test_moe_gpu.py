"""MoE models on the GPU: every decode and token-count graph replays what the eager forward computes (routing,
expert sorting and the expert kernels captured), greedy tokens equal transformers' (float32); the bf16 start-up self-check passes.""" 
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.runner.dispatch import Kind
from nanoserve.tiny import MOE_ARCHS
from tests.engine.test_engine import GREEDY, hf_greedy, prompts_of_lengths

pytestmark = pytest.mark.gpu


def _llm(path, **kw):
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, block_size=16, num_kv_blocks=256,
                cudagraph_capture_sizes="pow2", show_progress=False)
    opts.update(kw)
    return LLM(str(path), **opts)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_graphs_equal_eager_and_transformers(arch, tiny_moe_dirs):
    path = tiny_moe_dirs[arch]
    graphs, eager = _llm(path), _llm(path, enforce_eager=True)
    decode = graphs.engine.core.runner.graphs.runners[Kind.DECODE]
    assert decode.capture_sizes == [1, 2, 4, 8, 16]
    params = SamplingParams(max_tokens=24, **GREEDY)
    for b in (1, 3, 8, 13):
        prompts = prompts_of_lengths([5 + 7 * i for i in range(b)], 500, seed=b)
        got = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
        assert got == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)], b
        if b == 3:
            assert got == hf_greedy(str(path), prompts, 24)
    stats = graphs.engine.stats
    assert stats.decode_steps_graph > 0 and stats.prefill_steps_graph > 0 and stats.decode_steps_eager == 0


def test_bf16_start_up_self_check_covers_moe_layers(tiny_moe_dirs):
    """The start-up self-check replays every captured size against eager (it raises on a mismatch) in bf16, where
    the Triton expert kernels run; the engine then generates."""
    llm = _llm(tiny_moe_dirs["qwen2_moe"], dtype="bfloat16")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert len(out[0].token_ids) == 8
