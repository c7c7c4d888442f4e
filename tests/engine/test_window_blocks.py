"""The block manager under a sliding window on every layer: a running sequence's blocks wholly before its next
query's window go back to the pool (their entries become the placeholder), at the right positions, in chunks and
while decoding; it then never holds more than kernels.paging.blocks_for(n, bs, window); prefix hits need only the
blocks their first computed query reads."""
from __future__ import annotations

import random

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.paging import blocks_for
from nanoserve.sampling import SamplingParams

BS = 4


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def held(bm: BlockManager, seq: Sequence) -> list[int]:
    return [b for b in seq.block_table if b != bm.placeholder]


def check_accounting(bm: BlockManager, live: list[Sequence]):
    """Every block's refs are the live tables' real entries; placeholders form a prefix of each table."""
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    refs = {}
    for s in live:
        n = len(s.block_table) - len(held(bm, s))
        assert all(b == bm.placeholder for b in s.block_table[:n])
        for b in held(bm, s):
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)


def prefill(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    """What the scheduler does: prefix hits, then per chunk free what slid out, allocate, register, count computed."""
    hits = bm.cached_prefix(seq)
    end = min(len(hits) * BS + chunk, seq.num_tokens)
    assert bm.allocate(seq, end, hits)
    while True:
        bm.register_full_blocks(seq, end)
        seq.num_computed_tokens = end
        if end == seq.num_tokens:
            return
        bm.free_slid_out(seq)
        end = min(end + chunk, seq.num_tokens)
        assert bm.allocate(seq, end)


@pytest.mark.parametrize("window, computed, freed", [
    (6, 4, 0), (6, 8, 0), (6, 9, 1), (6, 12, 1), (6, 13, 2),  # a window across block edges
    (4, 6, 0), (4, 7, 1), (4, 11, 2), (1, 4, 1), (1, 3, 0),  # a window of whole blocks; of one key
])
def test_blocks_wholly_before_the_next_querys_window_are_freed(window, computed, freed):
    """A query at position p reads keys p - window + 1 .. p: the blocks before that one are freed."""
    bm = BlockManager(num_blocks=8, block_size=BS, window=window)
    seq = make_seq(range(20))
    assert bm.allocate(seq, 20)
    seq.num_computed_tokens = computed
    bm.free_slid_out(seq)
    assert seq.block_table[:freed] == [bm.placeholder] * freed and bm.placeholder not in seq.block_table[freed:]
    assert len(seq.block_table) == 5 and bm.num_free_blocks == 3 + freed
    check_accounting(bm, [seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8


def test_chunks_free_only_before_the_chunks_first_query():
    """A chunk's first query is its lowest position: blocks its queries read stay while it is scheduled."""
    bm = BlockManager(num_blocks=16, block_size=BS, window=6)
    seq = make_seq(range(40))
    for chunk_start, freed in ((0, 0), (16, 2), (32, 6)):
        seq.num_computed_tokens = chunk_start
        bm.free_slid_out(seq)
        assert seq.block_table.count(bm.placeholder) == freed
        assert bm.allocate(seq, min(chunk_start + 16, 40))
        check_accounting(bm, [seq])
    assert len(seq.block_table) == 10 and len(held(bm, seq)) == 4


def test_decoding_past_the_window_holds_at_most_the_windows_blocks():
    """A pool of 3 blocks decodes 60 tokens under a window of 6 (blocks_for(n, 4, 6) = 3 from n = 9 on)."""
    bm = BlockManager(num_blocks=3, block_size=BS, window=6)
    seq = make_seq(range(5))
    prefill(bm, seq, chunk=5)
    for t in range(55):
        seq.output_token_ids.append(t)
        seq.num_computed_tokens = seq.num_tokens - 1  # the decode query's position
        bm.free_slid_out(seq)
        assert bm.can_append_one(seq) and bm.allocate(seq, seq.num_tokens)
        bm.register_full_blocks(seq, seq.num_tokens)
        assert len(held(bm, seq)) <= blocks_for(seq.num_tokens, BS, 6)
        assert len(seq.block_table) == blocks_for(seq.num_tokens, BS)  # the table still indexes by position
        check_accounting(bm, [seq])
    assert blocks_for(60, BS, 6) == 3 and blocks_for(5, BS, 6) == 2 and blocks_for(60, BS) == 15


def test_no_window_frees_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(20))
    assert bm.allocate(seq, 20)
    seq.num_computed_tokens = 20
    bm.free_slid_out(seq)
    assert bm.placeholder not in seq.block_table and bm.num_free_blocks == 3


def test_a_hit_needs_only_the_blocks_its_first_query_reads():
    """Freed blocks stay cached until taken; a later prompt hits through blocks that were evicted outside its window,
    and stops where an evicted block lies inside it."""
    bm = BlockManager(num_blocks=8, block_size=BS, window=6)
    prompt = list(range(100, 124))  # six blocks
    a = make_seq(prompt, "a")
    prefill(bm, a, chunk=24)
    bm.free_slid_out(a)  # the next query is at 24: blocks 0-3 slid out
    assert len(held(bm, a)) == 2 and bm.num_free_blocks == 6
    b = make_seq(prompt + [1], "b")
    hits = bm.cached_prefix(b)
    assert hits == [bm.placeholder] * 4 + a.block_table[4:]
    prefill(bm, b, chunk=24)
    assert b.num_cached_tokens == 24 and b.block_table[:6] == hits
    c = make_seq(range(12), "c")  # unrelated: takes the never-used block, then a's blocks 0 and 1 (evicted)
    prefill(bm, c, chunk=12)
    d = make_seq(prompt + [2], "d")  # blocks 0, 1 gone, 2, 3 cached but free, 4, 5 held: a hit of 24 tokens
    assert len(bm.cached_prefix(d)) == 6
    e = make_seq(prompt[:12] + [3], "e")  # its first query (12) reads block 1, evicted: no hit
    assert bm.cached_prefix(e) == []
    check_accounting(bm, [a, b, c])
    for s in (a, b, c):
        bm.free(s)
    check_accounting(bm, [])


def test_a_block_freed_before_its_registration_keeps_the_hash_chain():
    """(Asynchronous decode registers a block a step late.) A block freed unregistered is no hit; the later blocks
    still register under the chain through it."""
    bm = BlockManager(num_blocks=8, block_size=BS, window=2)
    a = make_seq(range(12), "a")
    assert bm.allocate(a, 12)
    bm.register_full_blocks(a, 4)  # block 0 only
    block0 = a.block_table[0]
    a.num_computed_tokens = 12
    bm.free_slid_out(a)  # blocks 0 and 1 (the latter unregistered) slide out
    assert a.block_table[:2] == [bm.placeholder] * 2
    bm.register_full_blocks(a, 12)
    assert a.num_hashed_blocks == 3
    b = make_seq(list(range(12)) + [7], "b")
    assert bm.cached_prefix(b) == [bm.placeholder, bm.placeholder, a.block_table[2]]
    f = make_seq(list(range(8)) + [7], "f")  # block 1 was never registered: the hit ends at block 0 (freed, cached)
    assert bm.cached_prefix(f) == [block0]


@pytest.mark.parametrize("seed", range(3))
def test_random_churn_keeps_accounting_under_a_window(seed):
    """Shared prefixes, windowed hits, decodes that slide, frees: refs, the free queue and the placeholders agree."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=BS, window=rng.choice([1, 5, 8]))
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    for step in range(300):
        action = rng.random()
        if action < 0.3:
            seq = make_seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))], f"s{step}")
            hits = bm.cached_prefix(seq)
            if bm.allocate(seq, seq.num_tokens, hits):
                bm.register_full_blocks(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif action < 0.85 and live:
            seq = rng.choice(live)
            seq.output_token_ids.append(rng.randrange(50))
            bm.free_slid_out(seq)
            if bm.can_append_one(seq) and bm.allocate(seq, seq.num_tokens):
                bm.register_full_blocks(seq, seq.num_tokens - 1)
                seq.num_computed_tokens = seq.num_tokens
                assert len(held(bm, seq)) <= blocks_for(seq.num_tokens, BS, bm.window)
            else:
                bm.free(seq)
                live.remove(seq)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        check_accounting(bm, live)
