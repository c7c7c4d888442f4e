"""kernels/verify.store_samples against its PyTorch reference (CPU: Triton interpreter; GPU: CUDA)."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.verify import store_samples, store_samples_ref

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _case(seed: int, record: bool, verify: bool):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6 if verify else 2, (7,), generator=g).tolist()
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    slots = i32([s for s, n in zip(torch.randperm(9, generator=g).tolist(), sizes) for _ in range(n)])
    n = len(slots)
    tokens = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
    drafts = i32([x for m in sizes for x in [*torch.randint(0, 3, (m - 1,), generator=g).tolist(), -1]])
    back = i32([j for m in sizes for j in range(m)])
    positions = torch.randint(0, 40, (n,), generator=g, dtype=torch.int32)
    state = (torch.full((10,), -7, dtype=torch.int32), torch.full((10, 32), -7, dtype=torch.int32),
             torch.zeros(10, dtype=torch.int32))
    args = (drafts, back) if verify else (None, None)
    return tokens, slots, args, positions if record else None, state


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.usefixtures("force_triton")
def test_store_samples_matches_reference(device, record, verify):
    for seed in range(4):
        tokens, slots, (drafts, back), positions, state = _case(seed, record, verify)
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        want = [t.clone().to(device) for t in state]
        got = [t.clone().to(device) for t in state]
        hist = lambda s: (s[1], s[2]) if record else (None, None)  # noqa: E731
        store_samples_ref(on(tokens), on(slots), want[0], on(drafts), on(back), on(positions), *hist(want))
        store_samples(on(tokens), on(slots), got[0], on(drafts), on(back), on(positions), *hist(got))
        for w, o in zip(want, got):
            assert torch.equal(w, o)
        assert (want[0] != -7).any()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("record", [False, True])
@pytest.mark.usefixtures("force_triton")
def test_rows_of_the_pad_slot_store_nothing(device, record):
    """A graph's padded rows (slot pad_slot) leave last_tokens, histories and counts alone; the other rows store as
    without them."""
    for seed in range(3):
        tokens, slots, (drafts, back), positions, state = _case(seed, record, True)
        pad = int(slots[0])
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        want = [t.clone().to(device) for t in state]
        got = [t.clone().to(device) for t in state]
        hist = lambda s: (s[1], s[2]) if record else (None, None)  # noqa: E731
        real = slots != pad
        sub = lambda t: None if t is None else on(t[real])  # noqa: E731
        store_samples_ref(sub(tokens), sub(slots), want[0], sub(drafts), sub(back), sub(positions), *hist(want))
        store_samples(on(tokens), on(slots), got[0], on(drafts), on(back), on(positions), *hist(got), pad_slot=pad)
        for w, o in zip(want, got):
            assert torch.equal(w, o)
        assert got[0][pad] == -7
