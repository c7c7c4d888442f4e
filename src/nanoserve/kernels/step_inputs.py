"""The first kernel of a decode step: a batch's inputs from the device-resident per-slot state.

Row r runs slot slots[r]: its input id is that slot's last sampled token (or token_ids[r] where that is ≥ 0: a
draft being verified), its block table that slot's row of the persistent table after this step's one new block
(new_block_cols[r] ≥ 0) is written into it. One launch instead of the half-dozen small torch ops (index conversions,
index_put, two gathers) it replaces inside every decode graph.

A sequence verifying drafts runs as several consecutive rows of one slot (group_back[r]: how many rows of its slot
come before row r); each of them may bring a new block, and a row reads the blocks the rows before it bring. A row
never reads the persistent table for those (another program writes them, with no order between programs): it takes
them from the earlier rows' inputs, so rows never race.
"""
from __future__ import annotations

import torch

from nanoserve.kernels._triton import jit, next_power_of_2, tl, use_triton


def prepare_decode_ref(slots: torch.Tensor, new_block_cols: torch.Tensor, new_block_ids: torch.Tensor,
                       last_tokens: torch.Tensor, block_tables: torch.Tensor, width: int | None = None,
                       token_ids: torch.Tensor | None = None,
                       group_back: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (the CPU path and the oracle): (input_ids [r] int32, tables [r, width] int32); patches
    block_tables in place. (group_back only orders the Triton kernel's reads: every write lands before the gather
    here.)"""
    rows = slots.long()
    has = new_block_cols >= 0
    block_tables[rows[has], new_block_cols[has].long()] = new_block_ids[has].to(block_tables.dtype)
    width = block_tables.shape[1] if width is None else width
    ids = last_tokens[rows]
    if token_ids is not None:
        ids = torch.where(token_ids >= 0, token_ids, ids)
    return ids, block_tables[rows, :width]


def prepare_decode(slots: torch.Tensor, new_block_cols: torch.Tensor, new_block_ids: torch.Tensor,
                   last_tokens: torch.Tensor, block_tables: torch.Tensor, width: int | None = None,
                   token_ids: torch.Tensor | None = None,
                   group_back: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Graph-capturable on CUDA (no host sync); see prepare_decode_ref for the contract."""
    if not use_triton(slots):
        return prepare_decode_ref(slots, new_block_cols, new_block_ids, last_tokens, block_tables, width, token_ids)
    rows = slots.shape[0]
    width = block_tables.shape[1] if width is None else width
    ids = torch.empty(rows, dtype=torch.int32, device=slots.device)
    tables = torch.empty(rows, width, dtype=torch.int32, device=slots.device)
    if rows:
        block = min(next_power_of_2(width), 1024)
        verify = token_ids is not None
        _prepare_decode_kernel[(rows,)](slots, new_block_cols, new_block_ids, last_tokens, block_tables, ids, tables,
                                        token_ids if verify else slots, group_back if verify else slots,
                                        width, block_tables.stride(0), BLOCK=block, VERIFY=verify)
    return ids, tables


@jit
def _prepare_decode_kernel(slots_ptr, cols_ptr, blocks_ptr, last_ptr, table_ptr, ids_ptr, out_ptr, tokens_ptr,
                           back_ptr, width, stride_table, BLOCK: tl.constexpr, VERIFY: tl.constexpr):
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
