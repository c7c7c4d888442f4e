"""benchmarks/gluon_fp8_decode.py's experimental Gluon fp8 decode kernel (cp.async stages, fp8 wgmma) against
the fp32 oracle on a Hopper GPU: Qwen3's and Llama's groups, uneven contexts (one of one token), 1 and 3 splits, each
variant the benchmark sweeps, within 1.5 times the engine's kernel's largest error on the same case (both round the
output to bf16). Gluon has no CPU interpreter, so this check is GPU-only. (The independent-warps experiment that
followed it is the engine's kernel now: kernels/attention_sm90.py, tests/kernels/test_attention_sm90.py.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
VARIANTS = [{}, {"stages": 3}]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 32])
def test_gluon_fp8_decode_matches_its_oracle(heads):
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fp8 wgmma needs a Hopper GPU")
    pytest.importorskip("triton.experimental.gluon")
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    from fp8_dot_decode import engine_kernel, make_case, oracle
    from gluon_fp8_decode import gluon_decode

    case = make_case(4, heads, 8, 128, 208, 1, "cuda", seed=heads)
    case["lens"] = torch.tensor([200, 37, 1, 130], dtype=torch.int32, device="cuda")
    ref = oracle(case)
    scale = 128 ** -0.5
    engine = (engine_kernel(case, scale, False)(case["tables"][0]).float() - ref).abs().max().item()
    assert 0 < engine < 0.05
    errors = {}
    for i, rule in enumerate(VARIANTS):
        for splits in (1, 3):
            out = gluon_decode(case["q"], case["k8"], case["v8_t"], case["tables"][0], case["lens"], scale,
                               case["scales"], num_splits=splits, **rule)
            errors[(i, splits)] = (out.float() - ref).abs().max().item()
    assert max(errors.values()) <= 1.5 * engine, (engine, errors)
