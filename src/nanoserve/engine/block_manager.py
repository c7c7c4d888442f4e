"""Paged KV-cache blocks: allocate, extend, free, with hash-based prefix caching.

Every block is either in use (ref_count > 0) or on the free queue (ref_count == 0), so used + free ==
total always holds. A full block is registered under the hash of its tokens (chained with its
predecessors') once its tokens are known and their KV is scheduled; a later prompt with the same prefix
reuses it, until the block is taken fresh for something else (least recently freed first). Blocks
filled by a decode step are registered only when the host learns the sampled token (one step late with
asynchronous scheduling).
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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
        if needed + sum(self.blocks[b].ref_count == 0 for b in hits) > self.num_free_blocks:
            return False
        if not seq.block_table:
            for block_id in hits:
                self._take(block_id)
            seq.block_table = list(hits)
            seq.num_hashed_blocks = len(hits)
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
        """Blocks already holding seq's leading full blocks of known tokens (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits, prev, bs = [], None, self.block_size
        for i in range((seq.num_known_tokens - 1) // bs):
            chunk = tuple(seq.tokens_between(i * bs, (i + 1) * bs))
            prev = hash((prev, chunk))
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    # -- prefix registration ----------------------------------------------------------------------
    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among seq's first num_tokens tokens (all known, their KV scheduled)."""
        if not self.enable_prefix_caching:
            return
        bs, first, last = self.block_size, seq.num_hashed_blocks, min(num_tokens, seq.num_known_tokens) // self.block_size
        prev = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, min(last, len(seq.block_table))):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                chunk = tuple(seq.tokens_between(i * bs, (i + 1) * bs))
                block.hash, block.token_ids = hash((prev, chunk)), chunk
                self.hash_to_block[block.hash] = block.block_id
            prev = block.hash
            seq.num_hashed_blocks = i + 1

    # -- release ----------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_synced_blocks = seq.num_hashed_blocks = 0
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    # -- internals --------------------------------------------------------------------------------
    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1
        return block_id

    def _forget(self, block: Block) -> None:
        """A block taken fresh from the free queue forgets the content it was registered for."""
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
