"""Shared fixtures: tiny random HF-format models (llama, qwen2, qwen3), built once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # CPU CI: Triton kernels run in the interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from nanoserve.tiny import ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """arch → folder of a tiny model (config, safetensors, tokenizer, generation_config), one per arch."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def tiny_model_dir(request, tiny_model_dirs) -> Path:
    """The tiny model folder of each arch in turn (the test runs once per arch)."""
    return tiny_model_dirs[request.param]
