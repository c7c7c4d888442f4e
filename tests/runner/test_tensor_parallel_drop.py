"""Tensor-parallel engines dropped without close() (issue 17, case 5): as a test or a notebook does, one process
builds a two-rank LLM on CPU, generates, lets it go (garbage collection), builds another, and leaves the
last one to interpreter exit. Every engine's workers and process group are released in order: the second
engine starts and gives the same tokens, and the process exits 0 (it used to abort: SIGABRT, code 134)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, sys
    from nanoserve import LLM, SamplingParams

    OPTIONS = dict(device="cpu", dtype="float32", tensor_parallel_size=2, max_model_len=64, num_kv_blocks=64,
                   show_progress=False)
    PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    def tokens():
        llm = LLM(sys.argv[1], **OPTIONS)
        return llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].token_ids

    if __name__ == "__main__":
        print("first", tokens(), flush=True)  # dropped when tokens() returns
        gc.collect()
        kept = LLM(sys.argv[1], **OPTIONS)  # never closed: released at interpreter exit
        print("second", kept.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].token_ids, flush=True)
""")


def test_dropped_tensor_parallel_engines_release_cleanly(tiny_model_dirs, tmp_path):
    script = tmp_path / "drop.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dirs["qwen3"])], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("first", "second"))]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 2 and lines[0].split(" ", 1)[1] == lines[1].split(" ", 1)[1], proc.stdout
