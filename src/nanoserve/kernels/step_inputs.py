"""The first kernel of a decode step: a batch's inputs from the device-resident per-slot state.

Row r runs slot slots[r]: its input id is that slot's last sampled token (or token_ids[r] where that is ≥ 0: a
draft being verified), its block table that slot's row of the persistent table after this step's one new block
(new_block_cols[r] ≥ 0) is written into it. One launch instead of the half-dozen small torch ops (index conversions,
index_put, two gathers) it replaces inside every decode graph.

A sequence verifying drafts runs as several consecutive rows of one slot (group_back[r]: how many rows of its slot
come before row r); each of them may bring a new block, and a row reads the blocks the rows before it bring. A row
never reads the persistent table for those (another program writes them, with no order between programs): it takes
them from the earlier rows' inputs, so rows never race. (A row's entry at a column that a LATER row of its slot
brings is therefore unspecified; it lies past the row's own position, where attention never reads.)

Device rows (DeviceRows): speculative decoding keeps the asynchronous loop, so the host schedules step N+1 before it
knows how many drafts step N accepted. Such a row takes its position from the device's per-slot token count
(hist_len[slot] - 1 + group_back[r]) and its slot mapping and context length from that position, and its input and
draft ids (DEVICE_DRAFT entries) from the n-gram proposer's drafts of its sequence's first row.

Tail rows (DecodeTail): over an fp8 cache that keeps an exact tail (kernels/kv_quant.py), each row's tail row from its
slot and (resolved) position, written here rather than by a handful of torch ops in every decode graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.kernels._triton import HAS_TRITON, jit, next_power_of_2, tl, use_triton
from nanoserve.kernels.kv_quant import tail_row, tail_row_tl

DEVICE_DRAFT = -2  # a token_ids / draft_ids entry the device fills from the proposer's drafts
_DEVICE_DRAFT = tl.constexpr(DEVICE_DRAFT) if HAS_TRITON else DEVICE_DRAFT  # the kernel reads it


class DeviceRows(NamedTuple):
    """The device state some decode rows read instead of host values (all int32 on the rows' device)."""

    from_device: torch.Tensor   # [rows]: 1 → the row's position is hist_len[slot] - 1 + group_back[r]
    hist_len: torch.Tensor      # [num_slots + 1 or more]: per slot, tokens known on the device
    positions: torch.Tensor     # [rows] in/out: overwritten for from_device rows
    slot_mapping: torch.Tensor  # [rows] in/out: overwritten for from_device rows
    context_lens: torch.Tensor  # [rows] in/out: overwritten for from_device rows (position + 1)
    draft_ids: torch.Tensor     # [rows] in/out: DEVICE_DRAFT entries resolved (see prepare_decode)
    drafts: torch.Tensor        # [rows, K]: propose_ngram's drafts, row r's group read at row r - group_back[r]
    counts: torch.Tensor        # [rows]
    block_size: int


class DecodeTail(NamedTuple):
    """Where a decode batch's tail rows go (kv_quant.tail_row of each row's slot and position)."""

    positions: torch.Tensor  # [rows] int32: the rows' positions (device rows: as resolved here)
    tail_rows: torch.Tensor  # [rows] int32 out
    block_size: int


def _check_device(device: DeviceRows | None, token_ids: torch.Tensor | None, group_back: torch.Tensor | None) -> None:
    """One-line errors for device rows the kernel cannot take (shapes only: nothing here reads the device)."""
    if device is None:
        return
    if token_ids is None or group_back is None:
        raise ValueError("prepare_decode: device rows need token_ids and group_back")
    if device.drafts.dim() != 2 or device.drafts.shape[1] < 1 or device.drafts.stride(1) != 1:
        raise ValueError(f"prepare_decode: drafts must be [rows, K >= 1] with contiguous rows, got "
                         f"{list(device.drafts.shape)} strides {device.drafts.stride()}")


def _device_rows_ref(slots: torch.Tensor, ids: torch.Tensor, tables: torch.Tensor, token_ids: torch.Tensor,
                     group_back: torch.Tensor, device: DeviceRows) -> torch.Tensor:
    """prepare_decode_ref's device rows: returns the input ids, writes device's in/out fields."""
    back = group_back.long()
    first = torch.arange(back.shape[0], device=back.device) - back
    counts, group_drafts = device.counts[first], device.drafts[first]

    def draft(col: torch.Tensor, missing: int) -> torch.Tensor:  # drafts[first, col] where col < count
        found = group_drafts.gather(1, col.clamp(0, group_drafts.shape[1] - 1)[:, None])[:, 0]
        return torch.where((col >= 0) & (col < counts), found, missing)

    ids = torch.where(token_ids == DEVICE_DRAFT, draft(back - 1, 0), torch.where(token_ids >= 0, token_ids, ids))
    device.draft_ids.copy_(torch.where(device.draft_ids == DEVICE_DRAFT, draft(back, -1), device.draft_ids))
    on = device.from_device != 0
    pos = device.hist_len[slots.long()] - 1 + group_back
    col = torch.where(on, pos // device.block_size, 0).long()
    kv_slot = tables.gather(1, col[:, None])[:, 0] * device.block_size + pos % device.block_size
    device.positions.copy_(torch.where(on, pos, device.positions))
    device.context_lens.copy_(torch.where(on, pos + 1, device.context_lens))
    device.slot_mapping.copy_(torch.where(on, kv_slot, device.slot_mapping))
    return ids


def prepare_decode_ref(slots: torch.Tensor, new_block_cols: torch.Tensor, new_block_ids: torch.Tensor,
                       last_tokens: torch.Tensor, block_tables: torch.Tensor, width: int | None = None,
                       token_ids: torch.Tensor | None = None, group_back: torch.Tensor | None = None,
                       device: DeviceRows | None = None,
                       tail: DecodeTail | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (the CPU path and the oracle): (input_ids [r] int32, tables [r, width] int32); patches
    block_tables in place. (group_back only orders the Triton kernel's reads: every write lands before the gather
    here.) See prepare_decode for device rows and tail rows."""
    _check_device(device, token_ids, group_back)
    rows = slots.long()
    has = new_block_cols >= 0
    block_tables[rows[has], new_block_cols[has].long()] = new_block_ids[has].to(block_tables.dtype)
    width = block_tables.shape[1] if width is None else width
    ids, tables = last_tokens[rows], block_tables[rows, :width]
    if device is not None:
        ids = _device_rows_ref(slots, ids, tables, token_ids, group_back, device)
    elif token_ids is not None:
        ids = torch.where(token_ids >= 0, token_ids, ids)
    if tail is not None:
        tail.tail_rows.copy_(tail_row(slots, tail.positions, tail.block_size))
    return ids, tables


def prepare_decode(slots: torch.Tensor, new_block_cols: torch.Tensor, new_block_ids: torch.Tensor,
                   last_tokens: torch.Tensor, block_tables: torch.Tensor, width: int | None = None,
                   token_ids: torch.Tensor | None = None, group_back: torch.Tensor | None = None,
                   device: DeviceRows | None = None, tail: DecodeTail | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Graph-capturable on CUDA (no host sync); see prepare_decode_ref for the contract.

    tail: each row's tail row (kv_quant.tail_row of its slot and its position, a device row's as resolved here)
    written to tail.tail_rows.

    device (needs token_ids and group_back): for row r with g = group_back[r], first = r - g, c = counts[first]:
    token_ids[r] == DEVICE_DRAFT → input drafts[first, g - 1] if 0 ≤ g - 1 < c else 0 (a valid id; the row's outcome
    is discarded); draft_ids[r] == DEVICE_DRAFT → drafts[first, g] if g < c else -1, written back; from_device[r] →
    position hist_len[slot] - 1 + g, context length position + 1 and the KV slot through the row's gathered table
    (position // block_size must be < width)."""
    _check_device(device, token_ids, group_back)
    if not use_triton(slots):
        return prepare_decode_ref(slots, new_block_cols, new_block_ids, last_tokens, block_tables, width, token_ids,
                                  group_back, device, tail)
    rows = slots.shape[0]
    width = block_tables.shape[1] if width is None else width
    ids = torch.empty(rows, dtype=torch.int32, device=slots.device)
    tables = torch.empty(rows, width, dtype=torch.int32, device=slots.device)
    if rows:
        verify, on = token_ids is not None, device is not None
        dev = device if on else DeviceRows(*[slots] * 8, block_size=1)  # unread stand-ins without device rows
        tl_ = tail if tail is not None else DecodeTail(slots, slots, 1)
        _prepare_decode_kernel[(rows,)](
            slots, new_block_cols, new_block_ids, last_tokens, block_tables, ids, tables,
            token_ids if verify else slots, group_back if verify else slots, dev.from_device, dev.hist_len,
            dev.positions, dev.slot_mapping, dev.context_lens, dev.draft_ids, dev.drafts, dev.counts,
            tl_.positions, tl_.tail_rows, width, block_tables.stride(0), dev.drafts.stride(0),
            BLOCK=min(next_power_of_2(width), 1024), VERIFY=verify, DEVICE=on, KV_BLOCK=dev.block_size,
            TAIL=tail is not None, TAIL_BLOCK=tl_.block_size)
    return ids, tables


@jit
def _prepare_decode_kernel(slots_ptr, cols_ptr, blocks_ptr, last_ptr, table_ptr, ids_ptr, out_ptr, tokens_ptr,
                           back_ptr, from_ptr, hist_ptr, pos_ptr, kv_ptr, ctx_ptr, draft_ids_ptr, drafts_ptr,
                           counts_ptr, tail_pos_ptr, tail_ptr, width, stride_table, stride_drafts, BLOCK: tl.constexpr,
                           VERIFY: tl.constexpr, DEVICE: tl.constexpr, KV_BLOCK: tl.constexpr, TAIL: tl.constexpr,
                           TAIL_BLOCK: tl.constexpr):
    r = tl.program_id(0)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    col = tl.load(cols_ptr + r)
    new_block = tl.load(blocks_ptr + r)
    token = tl.load(last_ptr + slot)
    back = 0
    if VERIFY:
        given = tl.load(tokens_ptr + r)
        token = tl.where(given >= 0, given, token)
        back = tl.load(back_ptr + r)
    if DEVICE:  # (DEVICE implies VERIFY) the drafts of the row's group, its position from the slot's device count
        first = r - back
        count = tl.load(counts_ptr + first)
        group = drafts_ptr + first.to(tl.int64) * stride_drafts
        token = tl.where(given == _DEVICE_DRAFT, tl.load(group + back - 1, mask=(back >= 1) & (back <= count),
                                                         other=0), token)
        draft = tl.load(draft_ids_ptr + r)
        draft = tl.where(draft == _DEVICE_DRAFT, tl.load(group + back, mask=back < count, other=-1), draft)
        tl.store(draft_ids_ptr + r, draft)
        on = tl.load(from_ptr + r) != 0
        pos = tl.load(hist_ptr + slot) - 1 + back
        pos_col = tl.where(on, pos // KV_BLOCK, -1)
        entry = tl.full((), 0, tl.int32)  # the gathered table's entry at pos_col, taken from the tiles below
    tl.store(ids_ptr + r, token)
    row = table_ptr + slot * stride_table
    if col >= 0:
        tl.store(row + col, new_block)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < width
        vals = tl.load(row + offs, mask=ok, other=0)
        for i in range(1, back + 1):  # the blocks the rows before it in its slot bring (see the module docstring)
            vals = tl.where(offs == tl.load(cols_ptr + r - i), tl.load(blocks_ptr + r - i), vals)
        vals = tl.where(offs == col, new_block, vals)  # this program's own store, without a memory fence
        tl.store(out_ptr + r.to(tl.int64) * width + offs, vals, mask=ok)
        if DEVICE:
            entry += tl.sum(tl.where(offs == pos_col, vals, 0), axis=0)
    if DEVICE:
        if on:
            tl.store(pos_ptr + r, pos)
            tl.store(ctx_ptr + r, pos + 1)
            tl.store(kv_ptr + r, entry * KV_BLOCK + pos % KV_BLOCK)
    if TAIL:  # kv_quant.tail_row of the row's slot and position (a device row's as just resolved)
        at = tl.load(tail_pos_ptr + r).to(tl.int64)
        if DEVICE:
            at = tl.where(on, pos, at)
        tl.store(tail_ptr + r, tail_row_tl(slot, at, TAIL_BLOCK).to(tl.int32))
