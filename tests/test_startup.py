"""Start-up as a user meets it: the CLI answers --version, --help and argument errors without importing torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from nanoserve.cli import main
try:
    code = main({args!r})
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers", "fastapi", "nanoserve.server.app") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("args, code, says", [
    (["--version"], 0, "nanoserve 0.1.0"),
    (["serve", "--help"], 0, "nanoserve serve MODEL"),
    (["serve"], 2, "serve needs a model"),
    (["serve", "some/model", "--max-num-seqs", "0"], 2, "max_num_seqs must be a positive integer"),
    (["serve", "some/model", "--dtype", "int3"], 2, "dtype must be"),
    (["generate", "--model", "m", "--prompt", "x", "--enforce-eager", "maybe"], 2, "expected true/false"),
])
def test_cli_answers_without_importing_torch(args, code, says):
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert says in out.stdout + out.stderr
    assert "HEAVY=\n" in out.stderr, out.stderr  # none of them was imported


def test_version_is_quick():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "nanoserve", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "nanoserve 0.1.0"
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported and "nanoserve.cli" in imported


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def test_cpu_kv_cache_costs_memory_only_as_it_is_used(tiny_model_dirs):
    """A 0.25 GiB CPU KV cache (the cap: 256 rows × 2048 tokens would need 0.5 GiB) is mapped, not zero-filled: start-up
    and a short generate add far less than its size to the process, and the cache reads as zeros."""
    from nanoserve import LLM, SamplingParams

    before = _rss_bytes()
    with LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=2048, max_num_seqs=256, cpu_kv_cache_gb=0.25,
             show_progress=False) as llm:
        runner = llm.engine.core.runner
        assert runner.info.num_kv_blocks * runner.info.kv_block_bytes == 2**28  # what the cap holds
        out = llm.generate(["hello"] * 4, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        grown = _rss_bytes() - before
        assert all(o.finish_reason for o in out)
        assert grown < 2**28 / 4, f"the process grew by {grown / 2**20:.0f} MiB"
        assert float(runner.buffers.kv_cache[:, :, -100:].abs().sum()) == 0.0  # unwritten blocks are zeros
    with LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=128, max_num_seqs=4,
             show_progress=False) as small:  # below the cap: what 4 full-length rows can use
        assert small.engine.core.runner.info.num_kv_blocks == 4 * 128 // 16


def test_start_up_says_what_it_runs(tiny_model_dirs):
    out = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "--model", str(tiny_model_dirs["qwen3"]),
                          "--prompt", "hi", "--max-tokens", "2", "--device", "cpu", "--max-model-len", "64",
                          "--max-num-seqs", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ready = next(line for line in out.stderr.splitlines() if "engine ready in" in line)
    for part in ("Qwen3ForCausalLM", "float32 on cpu", "max_model_len 64", "max_num_seqs 4",
                 "KV cache float32: 0.00 GiB = 256 tokens (16 blocks of 16, ", "no CUDA graphs (no CUDA device)"):
        assert part in ready, ready
