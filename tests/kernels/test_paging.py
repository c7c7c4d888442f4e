"""The paged KV cache's addressing (kernels/paging.py): every form kv_slots takes gives the same slot as the layout's
definition, block_id * block_size + offset, and blocks_for counts a partly filled last block."""
import numpy as np
import pytest

from nanoserve.kernels.paging import blocks_for, kv_slots


def slot(table, p, bs):  # the layout, one position at a time
    return table[p // bs] * bs + p % bs


@pytest.mark.parametrize("n, bs, want", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 8, 5)])
def test_blocks_for(n, bs, want):
    assert blocks_for(n, bs) == want


def test_kv_slots_of_one_table_many_positions():
    table, bs = [7, 2, 9], 4
    got = kv_slots(table, np.arange(0, 12), bs)
    assert got.dtype == np.int32 and got.tolist() == [slot(table, p, bs) for p in range(12)]
    assert kv_slots(np.array(table, np.int32), np.arange(0, 12), bs).tolist() == got.tolist()


def test_kv_slots_of_rows_of_a_table_array():
    tables, bs = np.array([[0, 1], [5, 3]], np.int32), 16
    assert kv_slots(tables, 17, bs).tolist() == [slot(t, 17, bs) for t in tables]
    both = kv_slots(tables, np.arange(14, 18), bs)
    assert both.shape == (2, 4) and both.tolist() == [[slot(t, p, bs) for p in range(14, 18)] for t in tables]


def test_kv_slots_of_ragged_tables_one_position_each():
    tables, positions, bs = [[4], [1, 8, 3], [6, 2]], [3, 33, 16], 16
    got = kv_slots(tables, np.array(positions, np.int32), bs)
    assert got.dtype == np.int32 and got.tolist() == [slot(t, p, bs) for t, p in zip(tables, positions)]
