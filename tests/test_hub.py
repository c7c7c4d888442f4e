"""Models by hub id, resolved offline from a hub cache populated here in huggingface_hub's own layout
(models--org--name/{blobs,refs/main,snapshots/<commit>/...}): nothing is downloaded."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve import hub
from nanoserve.hub import HubModelError, is_hub_id, resolve_model
from tests.hub_cache import COMMIT, populate_hub_cache

@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_dirs, smollm2_gguf) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    tiny = tiny_model_dirs["qwen3"]
    populate_hub_cache(cache, "tiny-org/tiny-qwen3", {p.name: p for p in tiny.iterdir() if p.is_file()})
    populate_hub_cache(cache, "tiny-org/smol-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_gguf,
                                                     "README.md": tiny / "config.json"}, link=True)
    populate_hub_cache(cache, "tiny-org/two-GGUF", {"m.Q4_1.gguf": smollm2_gguf, "m.Q8_0.gguf": smollm2_gguf},
                       link=True)
    return cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/x-GGUF:Q4_K_M") and is_hub_id("org/x/m.Q8_0.gguf")
    assert not is_hub_id("/no/such/folder") and not is_hub_id("./a/b") and not is_hub_id("tiny")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a folder on disk is a path, whatever its shape
    assert resolve_model("org/name") == "org/name"


def test_snapshot_from_the_cache_offline(hub_cache, offline):
    folder = Path(resolve_model("tiny-org/tiny-qwen3", download_dir=str(hub_cache)))
    assert folder == hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert Path(resolve_model("tiny-org/tiny-qwen3", revision=COMMIT, download_dir=str(hub_cache))) == folder


def test_one_gguf_file_is_chosen(hub_cache, offline):
    d = str(hub_cache)
    only = Path(resolve_model("tiny-org/smol-GGUF", download_dir=d))
    assert only.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and only.is_file()
    assert Path(resolve_model("tiny-org/two-GGUF:q8_0", download_dir=d)).name == "m.Q8_0.gguf"
    assert Path(resolve_model("tiny-org/two-GGUF/m.Q4_1.gguf", download_dir=d)).name == "m.Q4_1.gguf"
    with pytest.raises(HubModelError, match=r"2 \.gguf files match .*m\.Q4_1\.gguf, m\.Q8_0\.gguf.*org/name:QUANT"):
        resolve_model("tiny-org/two-GGUF", download_dir=d)
    with pytest.raises(HubModelError, match="no .gguf files match 'Q2_K'"):
        resolve_model("tiny-org/two-GGUF:Q2_K", download_dir=d)


def test_a_model_neither_local_nor_cached_is_one_line(hub_cache, offline):
    with pytest.raises(HubModelError) as e:
        resolve_model("nobody/nothing-here", download_dir=str(hub_cache))
    message = str(e.value)
    assert "\n" not in message and "'nobody/nothing-here'" in message and "HF_HUB_OFFLINE" in message
    assert f"hf download nobody/nothing-here --cache-dir {hub_cache}" in message


def test_llm_by_hub_id(hub_cache, offline, tiny_model_dirs):
    from nanoserve import LLM, SamplingParams

    opts = dict(device="cpu", max_model_len=64, max_num_seqs=4, show_progress=False)
    params = SamplingParams(max_tokens=6, temperature=0)
    with LLM("tiny-org/tiny-qwen3", download_dir=str(hub_cache), **opts) as llm:
        by_id = llm.generate(["hello there"], params, use_tqdm=False)[0].token_ids
    with LLM(str(tiny_model_dirs["qwen3"]), **opts) as llm:
        assert llm.generate(["hello there"], params, use_tqdm=False)[0].token_ids == by_id


def test_a_draft_model_by_hub_id(hub_cache, offline, tiny_model_dirs):
    """speculative_config's draft "model" resolves like the model: a hub id from the cache, a missing one refused."""
    from nanoserve import LLM, SamplingParams

    opts = dict(device="cpu", max_model_len=64, max_num_seqs=4, show_progress=False, download_dir=str(hub_cache))
    spec = {"method": "draft_model", "model": "tiny-org/tiny-qwen3", "num_speculative_tokens": 3}
    with LLM(str(tiny_model_dirs["qwen3"]), speculative_config=spec, **opts) as llm:
        assert llm.engine.core.config.speculative.model == str(
            hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT)
        llm.generate(["hello there"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
        assert llm.engine.stats.spec_accepted_tokens == llm.engine.stats.spec_draft_tokens > 0
    with pytest.raises(HubModelError, match="nobody/nothing-here"):
        LLM(str(tiny_model_dirs["qwen3"]), speculative_config={**spec, "model": "nobody/nothing-here"}, **opts)


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_generate_with_a_missing_hub_model_is_one_line(hub_cache):
    out = _cli("generate", "--model", "nobody/nothing-here", "--prompt", "x", "--device", "cpu",
               env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "nobody/nothing-here" in out.stderr and "hf download nobody/nothing-here" in out.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_answers_at_once_in_one_line(hub_cache):
    """No network: one line naming the id and what to do, in seconds, not huggingface_hub's retries (~27 s)."""
    start = time.monotonic()
    out = _cli("serve", "nobody/nothing-here", "--port", str(_closed_port()),
               env={"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HUB_CACHE": str(hub_cache)})
    assert time.monotonic() - start <= 3.0
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "'nobody/nothing-here'" in out.stderr and "cannot be reached" in out.stderr
    assert "HF_HUB_OFFLINE=1" in out.stderr and "local model folder" in out.stderr


def test_an_unreachable_hub_resolves_from_the_cache(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    folder = Path(resolve_model("tiny-org/tiny-qwen3", download_dir=str(hub_cache)))
    assert folder == hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT


def test_the_hub_probe_is_bounded_in_time(monkeypatch):
    """A lookup or connection that hangs (a firewall dropping packets) is given up on after the probe's timeout."""
    def hang(*args, **kwargs):
        time.sleep(3)
        raise OSError("timed out")

    monkeypatch.setattr(hub.socket, "create_connection", hang)
    start = time.monotonic()
    assert not hub.hub_reachable(timeout=0.3)
    assert time.monotonic() - start < 1.5
