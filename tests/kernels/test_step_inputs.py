"""The decode-inputs kernel against its PyTorch reference (CPU: Triton interpreter; GPU: CUDA)."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels import kv_quant
from nanoserve.kernels.step_inputs import DEVICE_DRAFT, DecodeTail, DeviceRows, prepare_decode, prepare_decode_ref

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


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _random_device_batch(seed: int, block_size: int, width: int, gathered: int, k: int = 4):
    """Groups of 1..5 rows of distinct slots, each row from the device or not, new blocks where a row's position
    starts one (or, at random, a block ahead), then two padded rows (the dummy slot). Returns the prepare_decode
    arguments, the DeviceRows, and the gathered-table entries left unspecified (a column a later row brings)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda hi: int(torch.randint(0, hi, (), generator=g))  # noqa: E731
    num_slots = 8
    hist_len = torch.zeros(num_slots + 1, dtype=torch.int32)
    cols: list[list[int]] = [[] for _ in range(6)]  # slots, new_block_cols, token_ids, draft_ids, group_back, from
    unspecified = []
    for slot in torch.randperm(num_slots, generator=g)[:5].tolist():
        n = 1 + rand(5)
        hist_len[slot] = h = 1 + rand(gathered * block_size - n + 1)  # the last position fits the gathered width
        brought, first = set(), len(cols[0])
        for back in range(n):
            block = (h - 1 + back) // block_size
            col = block if (h - 1 + back) % block_size == 0 else block + 1 if rand(4) == 0 else -1
            col = -1 if col in brought or col >= width else col
            brought.add(col)
            unspecified += [(r, col) for r in range(first, first + back) if col >= 0]
            token = [-1, 7 + rand(900)] if back == 0 else [DEVICE_DRAFT, DEVICE_DRAFT, -1, 7 + rand(900)]
            draft = [DEVICE_DRAFT, DEVICE_DRAFT, -1, 7 + rand(900)]
            for column, v in zip(cols, (slot, col, token[rand(len(token))], draft[rand(4)], back, rand(3) != 0)):
                column.append(int(v))
    for column, v in zip(cols, (num_slots, -1, -1, -1, 0, 0)):
        column += [v, v]
    rows = len(cols[0])
    counts = torch.randint(0, k + 1, (rows,), generator=g, dtype=torch.int32)
    drafts = torch.randint(0, 50_000, (rows, k), generator=g, dtype=torch.int32)
    drafts[torch.arange(k) >= counts[:, None]] = 999_999  # the proposer writes -1 there: nothing may read them
    host = lambda: torch.randint(0, 1000, (rows,), generator=g, dtype=torch.int32)  # noqa: E731
    device = DeviceRows(_i32(*cols[5]), hist_len, host(), host(), host(), _i32(*cols[3]), drafts, counts, block_size)
    args = (_i32(*cols[0]), _i32(*cols[1]), torch.randint(0, 10_000, (rows,), generator=g, dtype=torch.int32),
            torch.randint(0, 50_000, (num_slots + 1,), generator=g, dtype=torch.int32),
            torch.randint(0, 10_000, (num_slots + 1, width), generator=g, dtype=torch.int32))
    return args, _i32(*cols[2]), _i32(*cols[4]), device, unspecified


def _on(device: DeviceRows, where: str) -> DeviceRows:
    return DeviceRows(*[t.clone().to(where) for t in device[:-1]], block_size=device.block_size)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size, width, gathered", [(4, 8, None), (2, 12, 9), (16, 3, None), (1, 40, 30)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.usefixtures("force_triton")
def test_device_rows_match_reference(device, block_size, width, gathered, seed):
    """Positions, KV slots, context lengths, input and draft ids from the device state: kernel == reference."""
    args, tokens, back, rows, unspecified = _random_device_batch(seed, block_size, width, gathered or width)
    want_rows, got_rows = _on(rows, device), _on(rows, device)
    want_tables, got_tables = args[4].clone().to(device), args[4].clone().to(device)
    common = [t.to(device) for t in args[:4]]
    tails = [DecodeTail(r.positions, torch.full_like(r.positions, -7), 4) for r in (want_rows, got_rows)]
    want = prepare_decode_ref(*common, want_tables, gathered, tokens.to(device), back.to(device), want_rows, tails[0])
    got = prepare_decode(*common, got_tables, gathered, tokens.to(device), back.to(device), got_rows, tails[1])
    assert torch.equal(got[0], want[0])
    assert torch.equal(got_tables, want_tables)
    # each row's tail row (an fp8 cache's: kernels/kv_quant.py) from its slot and its position as resolved
    assert torch.equal(tails[1].tail_rows, tails[0].tail_rows)
    assert torch.equal(tails[0].tail_rows, kv_quant.tail_row(common[0], want_rows.positions, 4))
    for r, c in unspecified:  # an earlier row's entry at a column a later row of its slot brings
        got[1][r, c] = want[1][r, c]
    assert torch.equal(got[1], want[1])
    for name in ("positions", "slot_mapping", "context_lens", "draft_ids"):
        assert torch.equal(getattr(got_rows, name), getattr(want_rows, name)), name
    on = rows.from_device.bool()
    assert on.any() and not on.all() and (tokens == DEVICE_DRAFT).any() and (rows.draft_ids == DEVICE_DRAFT).any()
    assert torch.equal(want_rows.positions.cpu()[~on], rows.positions[~on])  # host rows keep their values


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.usefixtures("force_triton")
def test_device_rows_by_hand(device):
    """Slot 2 verifies 3 drafts as rows 0..3 (hist_len 10, block_size 4: positions 9..12; the proposer found 2 of
    K=3 drafts, 500 and 501); row 1 brings block 55 at column 3 ahead, which row 3 (position 12) writes through.
    Row 4: a host row of slot 0; row 5: padding (dummy slot 4)."""
    tables = torch.tensor([[10, 11, 12, 13]] * 5, dtype=torch.int32)
    tables[2] = _i32(20, 21, 30, 98)
    last = _i32(100, 101, 102, 103, 104)
    slots, cols, blocks = _i32(2, 2, 2, 2, 0, 4), _i32(-1, 3, -1, -1, -1, -1), _i32(0, 55, 0, 0, 0, 0)
    tokens, back = _i32(-1, DEVICE_DRAFT, DEVICE_DRAFT, DEVICE_DRAFT, -1, -1), _i32(0, 1, 2, 3, 0, 0)
    drafts = _i32(500, 501, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 1, 1, 1, 1, 1).view(6, 3)  # rows 1..5: never read
    rows = DeviceRows(from_device=_i32(1, 1, 1, 1, 0, 0), hist_len=_i32(4, 0, 10, 0, 0),
                      positions=_i32(0, 0, 0, 0, 5, 0), slot_mapping=_i32(0, 0, 0, 0, 41, 7),
                      context_lens=_i32(0, 0, 0, 0, 6, 1), draft_ids=_i32(*[DEVICE_DRAFT] * 4, -1, -1),
                      drafts=drafts, counts=_i32(2, 3, 3, 3, 0, 0), block_size=4)
    for run in (prepare_decode, prepare_decode_ref):
        out, persistent = _on(rows, device), tables.clone().to(device)
        ids, gathered = run(*[t.to(device) for t in (slots, cols, blocks, last)], persistent, None,
                            tokens.to(device), back.to(device), out)
        assert ids.tolist() == [102, 500, 501, 0, 100, 104]  # row 3's draft would be the third: none, a dummy 0
        assert out.draft_ids.tolist() == [500, 501, -1, -1, -1, -1]
        assert out.positions.tolist() == [9, 10, 11, 12, 5, 0]
        assert out.context_lens.tolist() == [10, 11, 12, 13, 6, 1]
        assert out.slot_mapping.tolist() == [30 * 4 + 1, 30 * 4 + 2, 30 * 4 + 3, 55 * 4 + 0, 41, 7]
        assert persistent[2].tolist() == [20, 21, 30, 55]
        assert gathered[1:4].tolist() == [[20, 21, 30, 55]] * 3 and gathered[4].tolist() == [10, 11, 12, 13]


def test_device_rows_need_token_ids_and_group_back():
    args, tokens, back, rows, _ = _random_device_batch(0, 4, 8, 8)
    for run in (prepare_decode, prepare_decode_ref):
        with pytest.raises(ValueError, match="token_ids and group_back"):
            run(*args, None, None, back, rows)
        with pytest.raises(ValueError, match="token_ids and group_back"):
            run(*args, None, tokens, None, rows)
