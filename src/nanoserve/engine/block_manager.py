"""Paged KV-cache blocks: allocate, extend, free, with hash-based prefix caching.

Every block is either in use (ref_count > 0) or on the free queue (ref_count == 0), so used + free ==
total always holds. A full block is registered under the hash of its tokens (chained with its
predecessors') once its tokens are known and their KV is scheduled; a later prompt with the same prefix
reuses it, until the block is taken fresh for something else (least recently freed first). Blocks
filled by a decode step are registered only when the host learns the sampled token (one step late with
asynchronous scheduling).

With a sliding window of W keys on every layer (Mistral-v0.1, Phi-3-mini), a query at position p reads keys
p-W+1..p only, so a running sequence's blocks wholly before its next query's window are freed (free_slid_out):
their table entries become `placeholder` (the runner's dummy block past the pool: valid memory, never read by the
windowed kernels), so the table keeps indexing by position. They go to the free queue like any freed block and
stay cached until taken. A prefix hit then needs only the blocks its first computed query reads (cached_prefix):
older blocks of the hit may be gone. A model with any full-attention layer (Gemma 2/3) passes window=None: every
block stays readable, nothing is freed early.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.paging import blocks_for


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered for prefix reuse
    token_ids: tuple[int, ...] = ()  # the full block's tokens, to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        """window: the sliding window every layer has (None: some layer attends to the whole context)."""
        if window is not None and window < 1:
            raise ValueError(f"window must be a positive key count or None, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.placeholder = num_blocks  # a freed entry of a block table (the runner's dummy block)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # -- allocation -------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Make seq's blocks cover its first num_tokens tokens. A sequence without blocks first takes `hits`
        (its cached_prefix(), setting num_cached_tokens / num_computed_tokens). False, changing nothing,
        if the free blocks do not suffice."""
        assert not (hits and seq.block_table), "prefix hits apply to a sequence without blocks"
        have = len(seq.block_table) + len(hits)
        needed = max(self.blocks_for(max(num_tokens, have * self.block_size)) - have, 0)
        held_hits = [b for b in hits if b != self.placeholder]
        if needed + sum(self.blocks[b].ref_count == 0 for b in held_hits) > self.num_free_blocks:
            return False
        if not seq.block_table:
            for block_id in held_hits:
                self._take(block_id)
            seq.block_table = list(hits)
            seq.num_hashed_blocks = len(hits)
            seq.block_hash = self.blocks[hits[-1]].hash if hits else None  # (a hit's last block is held)
            seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        for _ in range(needed):
            block_id = next(iter(self.free_queue))
            self._forget(self.blocks[block_id])
            seq.block_table.append(self._take(block_id))
        return True

    def can_append_one(self, seq: Sequence) -> bool:
        """Room for one more token's KV (a decode step)."""
        return len(seq.block_table) * self.block_size > seq.num_tokens - 1 or self.num_free_blocks > 0

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding seq's leading full blocks of known tokens (at least one token left to compute).
        With a window, the longest hit whose blocks from the first computed query's window on (its last block at
        least) are cached; its entries before them are the placeholder (freed or evicted blocks are not read)."""
        if not self.enable_prefix_caching:
            return []
        found, prev, bs, run, best = [], None, self.block_size, 0, 0
        for i in range((seq.num_known_tokens - 1) // bs):
            chunk = tuple(seq.tokens_between(i * bs, (i + 1) * bs))
            prev = hash((prev, chunk))
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                if self.window is None:
                    break
                block_id, run = self.placeholder, 0
            else:
                run += 1  # the cached blocks ending at block i
            found.append(block_id)
            if run and i + 1 - run <= self._first_live_block((i + 1) * bs):
                best = i + 1
        first = min(self._first_live_block(best * bs), max(best - 1, 0))
        return [self.placeholder] * first + found[first:best]

    # -- prefix registration ----------------------------------------------------------------------
    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among seq's first num_tokens tokens (all known, their KV scheduled)."""
        if not self.enable_prefix_caching:
            return
        bs, first, last = self.block_size, seq.num_hashed_blocks, min(num_tokens, seq.num_known_tokens) // self.block_size
        prev = seq.block_hash if first > 0 else None
        for i in range(first, min(last, len(seq.block_table))):
            block_id = seq.block_table[i]
            block = None if block_id == self.placeholder else self.blocks[block_id]
            if block is None or block.hash is None:  # (a block freed before its last token was known: chain only)
                chunk = tuple(seq.tokens_between(i * bs, (i + 1) * bs))
                prev = hash((prev, chunk))
                if block is not None:
                    block.hash, block.token_ids = prev, chunk
                    self.hash_to_block[prev] = block_id
            else:
                prev = block.hash
            seq.num_hashed_blocks, seq.block_hash = i + 1, prev

    # -- release ----------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            if block_id != self.placeholder:
                self._release(block_id)
        seq.block_table = []
        seq.num_synced_blocks = seq.num_hashed_blocks = 0
        seq.num_cached_tokens = seq.num_computed_tokens = 0
        seq.block_hash = None

    def free_slid_out(self, seq: Sequence) -> None:
        """Return seq's blocks wholly before the window of its next query (position num_computed_tokens: the lowest
        any later step runs, a chunk's first query) to the pool; their entries become the placeholder. The steps in
        flight may still read them, but the device runs steps in order: a later step's writes come after."""
        table = seq.block_table
        end = min(self._first_live_block(seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] != self.placeholder:
            start -= 1
        for i in range(start, end):  # oldest first: it is the first to be taken fresh
            self._release(table[i])
            table[i] = self.placeholder

    def _first_live_block(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads: keys position - window + 1 on."""
        return 0 if self.window is None else max(position + 1 - self.window, 0) // self.block_size

    # -- internals --------------------------------------------------------------------------------
    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def _forget(self, block: Block) -> None:
        """A block taken fresh from the free queue forgets the content it was registered for."""
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
