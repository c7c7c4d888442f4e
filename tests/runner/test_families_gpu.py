"""The dense families at real shapes on the GPU (random weights, bf16): a Gemma-3-4B-shaped model (sandwich norms,
GeGLU, head_dim 256, windows of 1024 on five layers in six, local / global RoPE tables, the multimodal config's text
part) and a Mistral-7B-shaped one (a window of 4096 on every layer). Start-up self-checks every captured size against
eager; then each decode batch size gives an enforce_eager engine's tokens (up to bf16 near-ties), on prompts past the
window."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.runner.dispatch import Kind

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
import run  # noqa: E402  (the demo's rule for graph vs eager tokens in bf16: they may part only at a near-tie)

SHAPES_DIR = REPO / "benchmarks" / "shapes"
pytestmark = pytest.mark.gpu

# shape → (max_model_len, prompt length past its window)
SHAPES = {"gemma-3-4b": (2048, 1100), "mistral-7b": (8192, 4200)}


def _llm(name: str, **kw) -> LLM:
    max_len, prompt_len = SHAPES[name]
    # the KV blocks the test's 16 longest sequences need, not a share of the GPU: pytest -n 8 shares it
    blocks = 16 * (-(-(prompt_len + 16 + 6) // 16) + 1)
    opts = dict(device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, max_model_len=max_len,
                max_num_seqs=16, block_size=16, max_num_batched_tokens=max_len, cudagraph_capture_sizes="pow2",
                num_kv_blocks=blocks, show_progress=False)
    opts.update(kw)
    return LLM(str(SHAPES_DIR / name), **opts)


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_captured_size_replays_what_eager_computes(name):
    graphs = _llm(name)  # start-up's self-check already replayed every size against eager (it raises on a mismatch)
    decode = graphs.engine.core.runner.graphs.runners[Kind.DECODE]
    assert decode.capture_sizes == [1, 2, 4, 8, 16]
    prompt_len = SHAPES[name][1]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for b in decode.capture_sizes + [3, 11]:
        prompts = [[(7 * i + j) % 30000 + 3 for j in range(prompt_len + i)] for i in range(b)]
        results[b] = (prompts, [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)])
    assert graphs.engine.stats.decode_steps_graph > 0 and graphs.engine.stats.decode_steps_eager == 0
    graphs.close()
    # bf16 with random weights: the graph runs its bucket's rows and mixed steps replay token-count graphs (padded
    # GEMMs) where the eager engine runs the real rows, so logits differ by rounding and a greedy pick may flip where
    # two logits nearly tie. A random 7B model's logits reach |16..32|, where one bf16 step is 0.125: Mistral-7B at
    # b=4 parted three times at gaps of 0.0, 0.0 and 0.125 (experiments/gpu_mistral_904d0fd_h200.log), above the
    # demo's 0.1. A tie within two such steps is rounding; a divergence anywhere else is a failure.
    near_tie = 2 * 0.125
    eager_params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    with _llm(name, enforce_eager=True) as eager:
        for b, (prompts, got) in results.items():
            want = eager.generate(prompts, eager_params, use_tqdm=False)
            _, divergences = run.compare_tokens([SimpleNamespace(token_ids=t) for t in got], want, near_tie)
            assert all(d.near_tie for d in divergences), (b, divergences)
