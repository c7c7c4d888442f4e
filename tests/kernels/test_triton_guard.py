"""Without triton (CPU-only installs) every kernel module imports and takes its plain-PyTorch path."""
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
import torch.nn.functional as F
from nanoserve.kernels import _triton, attention, fused, gemv, rotary_kv
from nanoserve.kernels.switches import switched
assert not _triton.HAS_TRITON and attention.select_backend(torch.device("cuda")) == "torch"
x, w = torch.randn(2, 32), torch.randn(8, 32)
assert torch.equal(gemv.linear(x, w), F.linear(x, w))
assert torch.equal(fused.silu_and_mul(x), fused.silu_and_mul_ref(x))
with switched(force_triton=True):
    try:
        gemv.linear(x, w)
    except RuntimeError as e:
        assert "triton is not installed" in str(e)
    else:
        raise AssertionError("the force_triton switch without triton must fail")
    try:
        fused.silu_and_mul(x)
    except RuntimeError as e:
        assert "triton is not installed" in str(e), e
    else:
        raise AssertionError("a kernel launch without triton must fail")
print("ok")
"""


def test_kernel_modules_work_without_triton():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
