"""Paged KV-cache blocks: allocate, append, free, with hash-based prefix caching.

Every block is either in use (ref_count > 0) or on the free queue (ref_count == 0), so
used + free == total always holds. A freed full block keeps its content hash and can be
picked up again by a later prompt with the same prefix until it is reused for something else
(least recently freed first).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanoserve.engine.sequence import Sequence


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
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.free_set: set[int] = set(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_set)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- prefill --------------------------------------------------------------------------
    @staticmethod
    def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((prev_hash, token_ids))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold this sequence's leading full blocks (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits, prev, tokens = [], None, seq.token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            prev = self.chain_hash(prev, chunk)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        needed = seq.num_blocks_needed(self.block_size) - sum(self.blocks[b].ref_count > 0 for b in hits)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks; sets seq.num_cached_tokens."""
        assert not seq.block_table, "sequence already has blocks"
        hits = self._cached_prefix(seq)
        for block_id in hits:
            self._take(block_id, reuse=True)
        seq.block_table = list(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        for _ in range(len(hits), seq.num_blocks_needed(self.block_size)):
            seq.block_table.append(self._take(self.free_ids[0]))
        self._register_full_blocks(seq, len(hits), len(seq))

    # -- decode ---------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of seq's last token (the one the next decode step computes)."""
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make sure the block for seq's last token exists; register a block this token fills."""
        num_tokens = len(seq)
        if len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take(self.free_ids[0]))
        if num_tokens % self.block_size == 0:
            self._register_full_blocks(seq, num_tokens // self.block_size - 1, num_tokens)

    # -- release --------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_ids.append(block_id)
                self.free_set.add(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0

    # -- internals ------------------------------------------------------------------------
    def _take(self, block_id: int, reuse: bool = False) -> int:
        """Add a reference to block_id; a block taken fresh from the free queue forgets its old content."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if self.free_ids[0] == block_id:
                self.free_ids.popleft()
            else:
                self.free_ids.remove(block_id)
            self.free_set.discard(block_id)
            if not reuse:
                self._forget(block)
        block.ref_count += 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()

    def _register_full_blocks(self, seq: Sequence, first: int, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        prev = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            chunk = tuple(seq.tokens_between(i * self.block_size, (i + 1) * self.block_size))
            if block.hash is None:
                block.hash, block.token_ids = self.chain_hash(prev, chunk), chunk
                self.hash_to_block[block.hash] = block.block_id
            prev = block.hash
