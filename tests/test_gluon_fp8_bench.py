"""benchmarks/gluon_fp8_decode.py's experimental Gluon fp8 decode kernel (cp.async stages, fp8 wgmma) against
the fp32 oracle on a Hopper GPU: Qwen3's and Llama's groups, uneven contexts (one of one token), 1 and 3 splits, each
variant the benchmark sweeps, within 1.5 times the engine's kernel's largest error on the same case (both round the
output to bf16); and gluon_warp_decode.py's kernel likewise. Gluon has no CPU interpreter, so this check is GPU-only."""
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


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 32])
def test_gluon_warp_decode_matches_its_oracle(heads):
    """benchmarks/gluon_warp_decode.py's kernel (independent warps, fp8 mma.sync): the same check, its warps and
    stages variants, 1 and 3 splits, K and V^T by cp.async and (32-token head-major blocks) by TMA."""
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the experiment targets Hopper")
    pytest.importorskip("triton.experimental.gluon")
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    from fp8_dot_decode import engine_kernel, make_case, oracle
    from gluon_warp_decode import interleaved_scales, warp_decode

    case = make_case(4, heads, 8, 128, 208, 1, "cuda", seed=heads)
    case["lens"] = torch.tensor([200, 37, 1, 130], dtype=torch.int32, device="cuda")
    ref = oracle(case)
    scale = 128 ** -0.5
    engine = (engine_kernel(case, scale, False)(case["tables"][0]).float() - ref).abs().max().item()
    paired = interleaved_scales(case["scales"])
    errors = {}
    for warps, stages, splits in [(4, 2, 1), (4, 2, 3), (2, 3, 1), (2, 3, 3)]:
        out = warp_decode(case["q"], case["k8"], case["v8_t"], case["tables"][0], case["lens"], scale, paired,
                          num_warps=warps, stages=stages, num_splits=splits)
        errors[(warps, stages, splits)] = (out.float() - ref).abs().max().item()
    case = make_case(4, heads, 8, 128, 224, 1, "cuda", block=32, seed=heads, head_major=True)
    case["lens"] = torch.tensor([200, 37, 1, 130], dtype=torch.int32, device="cuda")
    ref = oracle(case)
    paired = interleaved_scales(case["scales"])
    for warps, splits in [(2, 1), (4, 3)]:
        out = warp_decode(case["q"], case["k8"], case["v8_t"], case["tables"][0], case["lens"], scale, paired,
                          num_warps=warps, num_splits=splits, tma=True)
        errors[("tma", warps, splits)] = (out.float() - ref).abs().max().item()
    assert max(errors.values()) <= 1.5 * engine, (engine, errors)
