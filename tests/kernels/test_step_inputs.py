"""The decode-inputs kernel against its PyTorch reference (CPU: Triton interpreter; GPU: CUDA)."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.step_inputs import prepare_decode, prepare_decode_ref

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # Triton on CPU tensors needs the interpreter


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, width, gathered", [(1, 4, None), (5, 37, None), (8, 1100, 300), (3, 16, 1)])
@pytest.mark.usefixtures("force_triton")
def test_prepare_decode_matches_reference(device, rows, width, gathered):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    num_slots = rows + 4
    tables = torch.randint(0, 10_000, (num_slots + 1, width), generator=g, dtype=torch.int32)
    last = torch.randint(0, 50_000, (num_slots + 1,), generator=g, dtype=torch.int32)
    slots = torch.randperm(num_slots, generator=g)[:rows].to(torch.int32)
    limit = width if gathered is None else gathered
    cols = torch.where(torch.rand(rows, generator=g) < 0.5, torch.randint(0, limit, (rows,), generator=g), -1)
    cols = cols.to(torch.int32)
    blocks = torch.randint(0, 10_000, (rows,), generator=g, dtype=torch.int32)
    args = [t.to(device) for t in (slots, cols, blocks, last)]
    ref_tables, got_tables = tables.clone().to(device), tables.clone().to(device)
    want = prepare_decode_ref(*args, ref_tables, gathered)
    got = prepare_decode(*args, got_tables, gathered)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_tables, ref_tables)  # the persistent table is patched the same way
    assert (cols >= 0).any() or rows == 1


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.usefixtures("force_triton")
def test_verification_rows_share_a_slot_and_its_new_blocks(device):
    """Rows of one slot (a sequence verifying drafts) each bring a new block; each row's table has the blocks the
    rows before it bring, its input is its draft (or the slot's last token where the draft is -1)."""
    width, g = 12, torch.Generator().manual_seed(5)
    tables = torch.randint(0, 1000, (6, width), generator=g, dtype=torch.int32)
    last = torch.arange(100, 106, dtype=torch.int32)
    # slot 3: four rows, new blocks at columns 4 and 5 (rows 1 and 3); slot 1: one plain row with a new block
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    slots, cols, blocks = i32(3, 3, 3, 3, 1), i32(-1, 4, -1, 5, 2), i32(0, 777, 0, 888, 999)
    tokens, back = i32(-1, 50, 51, 52, -1), i32(0, 1, 2, 3, 0)
    args = [t.to(device) for t in (slots, cols, blocks, last)]
    want_tables, got_tables = tables.clone().to(device), tables.clone().to(device)
    want = prepare_decode_ref(*args, want_tables, None, tokens.to(device))
    got = prepare_decode(*args, got_tables, None, tokens.to(device), back.to(device))
    assert got[0].tolist() == [103, 50, 51, 52, 101] == want[0].tolist()
    assert torch.equal(got_tables, want_tables)
    gathered = got[1].cpu()
    assert gathered[1, 4] == gathered[2, 4] == gathered[3, 4] == 777 and gathered[3, 5] == 888
    assert torch.equal(gathered[3], want[1][3].cpu()) and torch.equal(gathered[4], want[1][4].cpu())
