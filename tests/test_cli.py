"""The README's try-it path: `nanoserve make-tiny-model` then `nanoserve generate`, as a newcomer runs them."""
import json
import subprocess
import sys

import pytest


def run_cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=timeout)


def test_make_tiny_model_then_generate(tmp_path):
    made = run_cli("make-tiny-model", str(tmp_path / "tiny"), "--arch", "qwen2")
    assert made.returncode == 0, made.stderr
    gen = run_cli("generate", "--model", str(tmp_path / "tiny"), "--prompt", "Hello", "--prompt", "Bye",
                  "--max-tokens", "5", "--device", "cpu", "--max-model-len", "64", "--enforce-eager")
    assert gen.returncode == 0, gen.stderr
    lines = [json.loads(line) for line in gen.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello", "Bye"]
    assert all(x["num_tokens"] <= 5 and x["finish_reason"] in ("stop", "length") for x in lines)
    assert "decode runs eagerly" in gen.stderr  # the start-up log line


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/folder", "--prompt", "x"], "does not exist"),
    (["generate", "--model", ".", "--prompt", "x", "--dtype", "int3"], "dtype"),
])
def test_bad_input_is_one_clear_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
