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
