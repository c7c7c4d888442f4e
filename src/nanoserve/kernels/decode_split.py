"""How a split-K decode divides a sequence's keys among its splits: the rule every decode kernel (attention.py's
Triton kernels, attention_sm90.py's Gluon one) and the reduce that merges their partials share, on the device."""
from __future__ import annotations

from nanoserve.kernels._triton import jit, tl


@jit
def decode_partition(context_len, window, num_splits, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr = 1,
                     TAIL: tl.constexpr = False):
    """(first key, first tile, tokens per split, end of the split keys) of this sequence's decode: the keys
    [max(0, context_len - window), end) spread over all splits in whole tiles, from the tile that holds the window's
    first key (tile-aligned partitions keep the key-tile loads vectorised; the keys before the window in that tile
    are masked, not loaded), so blocks that slid out of the window are never read. Sized on the device from
    context_len, so a short context in an engine built for long ones still uses every split. end: context_len; with
    TAIL the start of the query's own block, whose keys one split reads exact from the tail (tail_split) — possibly
    before the first tile, when no fp8 key is left to split."""
    window_start = tl.maximum(context_len - window, 0)
    first_tile = window_start // BLOCK_N * BLOCK_N
    if TAIL:
        end = tl.maximum(context_len - 1, 0) // BLOCK_SIZE * BLOCK_SIZE
        span = tl.maximum(end - first_tile, 0)
    else:
        end = context_len
        span = context_len - first_tile
    return window_start, first_tile, tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N), 1) * BLOCK_N, end


@jit
def tail_split(first_tile, partition_size, split_end, num_splits):
    """(the split that reads the own block's exact keys, how many splits hold partials) of a decode with a tail: the
    first split left without fp8 keys, so the tail's loads run beside the fp8 tiles instead of after them (b = 1 reads
    512 tokens in a few of its splits); split 0 when every split has fp8 keys."""
    used = tl.cdiv(tl.maximum(split_end - first_tile, 0), partition_size)
    tail_split = tl.where(used < num_splits, used, 0)
    return tail_split, tl.minimum(used + 1, num_splits)
