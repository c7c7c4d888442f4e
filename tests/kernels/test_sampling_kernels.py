"""The token-bitmask kernel == its PyTorch reference (CPU via TRITON_INTERPRET=1, set in conftest; CUDA when present),
and the reference == xgrammar's own masking."""
import numpy as np
import pytest
import torch

from nanoserve.kernels import sampling
from nanoserve.kernels._triton import HAS_TRITON

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def key(seed: int, device) -> torch.Tensor:
    """A call's noise key as sample_tokens reads it."""
    return torch.tensor([seed], dtype=torch.int64, device=device)


def random_case(rows: int, vocab: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # a row that allows every token
    return logits, bitmask


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, vocab", [(1, 100), (3, 2 * sampling.MASK_BLOCK + 77), (5, 4096)])
@pytest.mark.usefixtures("force_triton")
def test_kernel_equals_reference(dtype, rows, vocab):
    logits, bitmask = random_case(rows, vocab, dtype, seed=vocab)
    wide = torch.zeros(rows, vocab + 64, dtype=dtype)  # rows of a wider buffer: the row stride is not the vocab
    wide[:, :vocab] = logits
    logits, bitmask = wide[:, :vocab].to(DEVICE), bitmask.to(DEVICE)
    got = sampling.masked_float_logits(logits, bitmask)
    want = sampling.masked_float_logits_ref(logits, bitmask)
    assert got.dtype == torch.float32 and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want)
    assert torch.equal(logits, wide[:, :vocab].to(DEVICE))  # the input is left as it was


def test_reference_masks_as_xgrammar_does():
    xgr = pytest.importorskip("xgrammar")
    logits, bitmask = random_case(4, 1000, torch.float32, seed=7)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(sampling.masked_float_logits(logits, bitmask), want)


def test_a_mask_too_narrow_is_refused():
    with pytest.raises(ValueError, match=r"int32 \[2, >= 4\]"):
        sampling.masked_float_logits(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))



def sample_case(rows: int, vocab: int, dtype, seed: int, masked: bool, device: str = DEVICE):
    logits, bitmask = random_case(rows, vocab, dtype, seed)
    temperature = torch.tensor([(0.0, 0.7, 1.0, 1.6)[i % 4] for i in range(rows)])
    slots = torch.randperm(2 * rows, generator=torch.Generator().manual_seed(seed))[:rows].to(torch.int32)
    return logits.to(device), bitmask.to(device) if masked else None, temperature.to(device), slots.to(device)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("rows, vocab", [(1, 100), (6, 3 * sampling.SAMPLE_BLOCK * sampling.SAMPLE_ITERS + 77)])
def test_sample_kernel_equals_reference(masked, rows, vocab):
    """The same tokens as the numpy Philox oracle, greedy and sampled rows, with and without a mask; stored in the
    slots' cells; the scratch is reset, so a second call (another seed) is right too."""
    logits, bitmask, temperature, slots = sample_case(rows, vocab, torch.bfloat16, vocab, masked)
    scratch = sampling.SampleScratch(8, logits.device)
    last = torch.full((2 * rows,), -1, dtype=torch.int32, device=logits.device)
    for seed in (12345, 2**31 - 1):
        got = sampling.sample_tokens(logits, bitmask, temperature, key(seed, logits.device), slots, last, scratch)
        want = sampling.sample_tokens_ref(logits, bitmask, temperature, seed)
        assert torch.equal(got.cpu(), want)
        assert torch.equal(last[slots.long()].cpu(), want)
    assert (scratch.done == 0).all() and (scratch.best == torch.iinfo(torch.int64).min).all()
    if masked:  # every token it took is allowed
        allowed = sampling.masked_float_logits_ref(logits.float().cpu(), bitmask.cpu()).isfinite()
        assert allowed[torch.arange(rows), want.long()].all()


def test_reference_draws_from_the_softmax():
    """The oracle's Gumbel-max draws follow softmax(logits / T) (chi-square over many rows of one distribution)."""
    rows, vocab, t = 4000, 8, 0.8
    logits = torch.linspace(-1.0, 1.5, vocab).repeat(rows, 1)
    tokens = sampling.sample_tokens_ref(logits, None, torch.full((rows,), t), seed=7)
    counts = torch.bincount(tokens.long(), minlength=vocab).double()
    expected = rows * torch.softmax(logits[0].double() / t, dim=0)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (counts, expected)  # the 0.999 quantile at 7 degrees of freedom


def test_the_noise_is_finite_at_both_ends():
    """The extreme Philox words map strictly inside (0, 1): a draw of 1.0 would give infinite noise, a token that
    beats every other whatever its logit or mask."""
    u = sampling.uniform_ref(np.array([0, 0xFFFFFFFF], np.uint32))
    assert 0 < u[0] and u[1] < 1 and np.isfinite(-np.log(-np.log(u))).all()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_sparse_mask_is_never_escaped():
    """A few allowed tokens per row, far apart, at a high temperature: every draw is one of them."""
    rows, vocab = 3, 2 * sampling.SAMPLE_BLOCK * sampling.SAMPLE_ITERS + 5
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[:, [3, 4100, vocab - 1]] = True
    bits = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    bitmask = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32).to(DEVICE)
    scratch = sampling.SampleScratch(rows, logits.device)
    slots = torch.arange(rows, dtype=torch.int32, device=logits.device)
    last = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    for seed in range(6):
        got = sampling.sample_tokens(logits, bitmask, torch.full((rows,), 5.0, device=logits.device),
                                     key(seed, logits.device), slots, last, scratch)
        assert allowed[torch.arange(rows), got.cpu().long()].all()
