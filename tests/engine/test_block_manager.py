import random

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling import SamplingParams


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does for a whole-prompt prefill: prefix hits, blocks for every token, registration."""
    if not bm.allocate(seq, seq.num_tokens, bm.cached_prefix(seq)):
        return False
    bm.register_full_blocks(seq, seq.num_tokens)
    return True


def check_accounting(bm: BlockManager, live: list[Sequence]):
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    refs = {}
    for s in live:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)


def test_allocate_extend_free_exact_accounting():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))  # 3 blocks
    assert admit(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    for t in range(10, 13):  # tokens 10, 11 fit the third block; 12 needs a fourth
        seq.output_token_ids.append(t)
        assert bm.can_append_one(seq) and bm.allocate(seq, seq.num_tokens)
    assert len(seq.block_table) == 4
    check_accounting(bm, [seq])
    bm.free(seq)
    assert bm.num_used_blocks == 0 and seq.block_table == []
    check_accounting(bm, [])


def test_allocation_fails_without_change_beyond_capacity():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(range(9))
    assert not bm.allocate(seq, 9) and seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(make_seq(range(8)), 8)


def test_chunks_extend_the_table_block_by_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(20))
    for end, blocks in ((6, 2), (8, 2), (13, 4), (20, 5)):
        assert bm.allocate(seq, end) and len(seq.block_table) == blocks
    check_accounting(bm, [seq])


def test_prefix_cache_reuses_full_blocks_and_keeps_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(12), "a")
    admit(bm, a)
    assert a.num_cached_tokens == 0
    b = make_seq(list(range(12)) + [99], "b")  # shares three full blocks
    admit(bm, b)
    assert b.num_cached_tokens == b.num_computed_tokens == 12 and b.block_table[:3] == a.block_table
    c = make_seq(range(12), "c")  # identical prompt: the last block is recomputed so one token has logits
    admit(bm, c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2] and c.block_table[2] != a.block_table[2]
    check_accounting(bm, [a, b, c])
    for s in (a, b, c):
        bm.free(s)
    check_accounting(bm, [])
    d = make_seq(list(range(8)) + [7, 7, 7, 7, 7], "d")  # freed blocks still serve as cache until reused
    admit(bm, d)
    assert d.num_cached_tokens == 8
    check_accounting(bm, [d])


def test_only_registered_blocks_are_hits():
    """A block is a hit only once registered (its KV scheduled): an allocated but uncomputed chunk is not."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(16), "a")
    assert bm.allocate(a, 16, bm.cached_prefix(a))
    bm.register_full_blocks(a, 8)  # only the first chunk (8 tokens) is scheduled so far
    b = make_seq(range(17), "b")
    assert len(bm.cached_prefix(b)) == 2
    bm.register_full_blocks(a, 16)
    assert len(bm.cached_prefix(b)) == 4


def test_prefix_cache_disabled():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a, b = make_seq(range(12), "a"), make_seq(range(13), "b")
    admit(bm, a)
    admit(bm, b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_evicted_block_is_not_a_false_hit():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    b = make_seq(range(100, 109), "b")  # takes all three blocks, overwriting a's content
    admit(bm, b)
    bm.free(b)
    c = make_seq(range(9), "c")
    admit(bm, c)
    assert c.num_cached_tokens == 0
    check_accounting(bm, [c])


@pytest.mark.parametrize("seed", range(5))
def test_random_churn_keeps_accounting(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    for step in range(400):
        action = rng.random()
        if action < 0.3:
            seq = make_seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))], f"s{step}")
            if admit(bm, seq):
                live.append(seq)
        elif action < 0.8 and live:
            seq = rng.choice(live)
            seq.output_token_ids.append(rng.randrange(50))
            if bm.can_append_one(seq) and bm.allocate(seq, seq.num_tokens):
                bm.register_full_blocks(seq, seq.num_tokens)
                assert len(seq.block_table) * 4 >= len(seq)
            else:
                bm.free(seq)
                live.remove(seq)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        check_accounting(bm, live)
