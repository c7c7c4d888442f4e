"""The token-bitmask kernel == its PyTorch reference (CPU via TRITON_INTERPRET=1, set in conftest; CUDA when present),
and the reference == xgrammar's own masking."""
import pytest
import torch

from nanoserve.kernels import logit_mask
from nanoserve.kernels._triton import HAS_TRITON

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(rows: int, vocab: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # a row that allows every token
    return logits, bitmask


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, vocab", [(1, 100), (3, 2 * logit_mask.BLOCK + 77), (5, 4096)])
def test_kernel_equals_reference(dtype, rows, vocab):
    logits, bitmask = random_case(rows, vocab, dtype, seed=vocab)
    wide = torch.zeros(rows, vocab + 64, dtype=dtype)  # rows of a wider buffer: the row stride is not the vocab
    wide[:, :vocab] = logits
    logits, bitmask = wide[:, :vocab].to(DEVICE), bitmask.to(DEVICE)
    got = logit_mask.masked_float_logits(logits, bitmask, force_triton=True)
    want = logit_mask.masked_float_logits_ref(logits, bitmask)
    assert got.dtype == torch.float32 and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want)
    assert torch.equal(logits, wide[:, :vocab].to(DEVICE))  # the input is left as it was


def test_reference_masks_as_xgrammar_does():
    xgr = pytest.importorskip("xgrammar")
    logits, bitmask = random_case(4, 1000, torch.float32, seed=7)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(logit_mask.masked_float_logits(logits, bitmask), want)


def test_a_mask_too_narrow_is_refused():
    with pytest.raises(ValueError, match=r"int32 \[2, >= 4\]"):
        logit_mask.masked_float_logits(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))

