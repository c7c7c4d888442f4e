"""The first kernel of a decode step: a batch's inputs from the device-resident per-slot state.

Row r runs slot slots[r]: its input id is that slot's last sampled token, its block table that slot's
row of the persistent table after this step's one new block (new_block_cols[r] ≥ 0) is written into
it. One launch instead of the half-dozen small torch ops (index conversions, index_put, two gathers)
it replaces inside every decode graph. Each row touches only its own slot, so rows never race.
"""
from __future__ import annotations

import torch

from nanoserve.kernels._triton import jit, next_power_of_2, tl, use_triton


def prepare_decode_ref(slots: torch.Tensor, new_block_cols: torch.Tensor, new_block_ids: torch.Tensor,
                       last_tokens: torch.Tensor, block_tables: torch.Tensor,
                       width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (the CPU path and the oracle): (input_ids [r] int32, tables [r, width] int32); patches
    block_tables in place."""
    rows = slots.long()
    has = new_block_cols >= 0
    block_tables[rows[has], new_block_cols[has].long()] = new_block_ids[has].to(block_tables.dtype)
    width = block_tables.shape[1] if width is None else width
    return last_tokens[rows], block_tables[rows, :width]


def prepare_decode(slots: torch.Tensor, new_block_cols: torch.Tensor, new_block_ids: torch.Tensor,
                   last_tokens: torch.Tensor, block_tables: torch.Tensor,
                   width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Graph-capturable on CUDA (no host sync); see prepare_decode_ref for the contract."""
    if not use_triton(slots):
        return prepare_decode_ref(slots, new_block_cols, new_block_ids, last_tokens, block_tables, width)
    rows = slots.shape[0]
    width = block_tables.shape[1] if width is None else width
    ids = torch.empty(rows, dtype=torch.int32, device=slots.device)
    tables = torch.empty(rows, width, dtype=torch.int32, device=slots.device)
    if rows:
        block = min(next_power_of_2(width), 1024)
        _prepare_decode_kernel[(rows,)](slots, new_block_cols, new_block_ids, last_tokens, block_tables, ids, tables,
                                        width, block_tables.stride(0), BLOCK=block)
    return ids, tables


@jit
def _prepare_decode_kernel(slots_ptr, cols_ptr, blocks_ptr, last_ptr, table_ptr, ids_ptr, out_ptr, width,
                           stride_table, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    col = tl.load(cols_ptr + r)
    new_block = tl.load(blocks_ptr + r)
    tl.store(ids_ptr + r, tl.load(last_ptr + slot))
    row = table_ptr + slot * stride_table
    if col >= 0:
        tl.store(row + col, new_block)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < width
        vals = tl.load(row + offs, mask=ok, other=0)
        vals = tl.where(offs == col, new_block, vals)  # this program's own store, without a memory fence
        tl.store(out_ptr + r.to(tl.int64) * width + offs, vals, mask=ok)
