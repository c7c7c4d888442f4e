"""The draft proposers of speculative decoding (engine/drafts.py): prompt lookup ("ngram") and suffix decoding
("suffix") against hand-made cases and brute-force oracles that rescan every token at every step."""
from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from nanoserve.engine.drafts import NgramProposer, SuffixProposer, make_proposer
from nanoserve.engine.suffix_trie import ROOT, SequenceTrie, SuffixTrie
from nanoserve.speculative_config import SpeculativeConfig


# ---- ngram ---------------------------------------------------------------------------------------------------

def ngram_oracle(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Rescan: the longest n whose suffix n-gram occurred earlier; what followed its latest earlier occurrence."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if n < size and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def ngram(prompt, lo=1, hi=3) -> NgramProposer:
    proposer = NgramProposer(lo, hi)
    proposer.add("r", prompt)
    return proposer


def test_ngram_copies_what_followed_an_earlier_span():
    assert ngram([5, 6, 7, 8, 9, 1, 6, 7]).propose("r", 3) == [8, 9, 1]
    assert ngram([5, 6, 7, 8, 9, 1, 6, 7]).propose("r", 10) == [8, 9, 1, 6, 7]  # up to the last known token
    assert ngram([5, 6, 7, 8, 9, 1, 6, 7]).propose("r", 0) == []
    assert ngram([1, 2, 3, 4]).propose("r", 3) == []  # nothing repeats
    assert ngram([]).propose("r", 3) == []


def test_ngram_longest_n_wins_then_the_latest_occurrence():
    # "2 3" then 7 earlier, "1 2 3" then 8 earlier still: the 3-gram wins over the more recent 2-gram
    assert ngram([1, 2, 3, 8, 0, 2, 3, 7, 1, 2, 3]).propose("r", 1) == [8]
    assert ngram([1, 2, 3, 8, 0, 2, 3, 7, 1, 2, 3], hi=2).propose("r", 1) == [7]
    assert ngram([4, 1, 9, 4, 1, 8, 4, 1]).propose("r", 2) == [8, 4]  # the most recent of two occurrences
    assert ngram([4, 1, 9, 4, 1, 8, 4, 1], lo=3, hi=3).propose("r", 2) == []  # "8 4 1" is new


def test_ngram_suffix_never_matches_itself():
    assert ngram([3, 3]).propose("r", 4) == [3]  # "3" at 0 (followed by 3): not the last "3" itself
    assert ngram([7]).propose("r", 4) == []
    assert ngram([1, 2, 1, 2], lo=2, hi=2).propose("r", 5) == [1, 2]
    assert ngram([1, 2, 3], lo=3, hi=3).propose("r", 5) == []


def test_ngram_extend_in_chunks_equals_one_by_one():
    rng = random.Random(0)
    stream = [rng.randrange(4) for _ in range(300)]
    whole, single = ngram(stream[:10], 2, 4), ngram(stream[:10], 2, 4)
    at = 10
    while at < len(stream):
        step = rng.randint(1, 5)
        whole.extend("r", stream[at:at + step])
        for token in stream[at:at + step]:
            single.extend("r", [token])
        at += step
        assert whole.propose("r", 6) == single.propose("r", 6)


@pytest.mark.parametrize("seed", range(30))
def test_ngram_matches_the_rescan(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi, vocab, k = lo + rng.randint(0, 3), rng.randint(2, 6), rng.randint(1, 8)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
    proposer = ngram(tokens, lo, hi)
    for _ in range(60):
        got = proposer.propose("r", k)
        assert got == ngram_oracle(tokens, lo, hi, k)
        assert len(got) <= k
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        proposer.extend("r", new)
        tokens += new


# ---- suffix --------------------------------------------------------------------------------------------------

def count(seqs: list[list[int]], s: list[int]) -> int:
    return sum(seq[i:i + len(s)] == s for seq in seqs for i in range(len(seq) - len(s) + 1))


def suffix_draft(seqs, depth, context, limit, min_prob) -> tuple[list[int], float]:
    """Rescan: follow the most frequent continuation (ties: the smallest id) of the context, dropping its first
    token at the depth, while the product of count(s t) / count(s) stays >= min_prob."""
    s, out, prob, score = list(context), [], 1.0, 0.0
    while len(out) < limit:
        if len(s) == depth:
            s = s[1:]
        follows = Counter(seq[i + len(s)] for seq in seqs for i in range(len(seq) - len(s))
                          if seq[i:i + len(s)] == s)
        if not follows:
            break
        token = min(follows, key=lambda t: (-follows[t], t))
        prob *= follows[token] / count(seqs, s)
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        s.append(token)
    return out, score


def suffix_oracle(tokens, cached, depth, k, factor, min_prob) -> list[int]:
    """Rescan: the best score over the request's own tokens then the cached outputs, every match length (longest
    first; a tie keeps the earlier)."""
    best = ([], 0.0)
    for seqs in ([tokens], cached):
        for m in range(min(len(tokens), depth - 1), 0, -1):
            if seqs and count(seqs, tokens[-m:]):
                draft = suffix_draft(seqs, depth, tokens[-m:], min(k, int(factor * m + 1e-6)), min_prob)
                if draft[1] > best[1] + 1e-9:  # a tie keeps the earlier
                    best = draft
    return best[0]


def suffix(depth=24, cached=10, factor=1.0, min_prob=0.1) -> SuffixProposer:
    return SuffixProposer(depth, cached, factor, min_prob)


def test_suffix_proposes_a_finished_request_s_output_to_a_request_that_starts_the_same():
    proposer = suffix()
    proposer.add("a", [1, 2, 3])
    proposer.extend("a", [10, 11, 12, 13, 14, 15, 16, 17])
    proposer.remove("a")
    proposer.add("b", [9, 9, 10, 11, 12, 13])
    assert proposer.propose("b", 8) == [14, 15, 16, 17]  # matched 4: factor 1.0 drafts 4
    proposer.add("c", [1, 2, 3])  # prompts are not cached: only outputs
    assert proposer.propose("c", 8) == []
    proposer.add("d", [10])
    proposer.remove("d", keep_outputs=True)  # no outputs: nothing cached
    proposer.add("e", [5, 4])
    proposer.extend("e", [3, 2])
    proposer.remove("e", keep_outputs=False)
    proposer.add("f", [4, 3])
    assert proposer.propose("f", 8) == []


def test_suffix_proposes_the_request_s_own_repetition():
    proposer = suffix()
    proposer.add("r", [7, 1, 2, 3, 4, 5, 8, 1, 2, 3])
    # "1 2 3" occurred twice, once followed by 4: count 1 / 2 (the current one has no continuation yet)
    assert proposer.propose("r", 8) == [4, 5, 8]
    proposer.add("loop", [5] * 10)  # the longest match (9) has one earlier occurrence: [5] at 1/2
    # matched m drafts ≤ m tokens at (10 - m) / (11 - m), (9 - m) / (11 - m) …: m = 4 scores best (18/7)
    assert proposer.propose("loop", 32) == [5] * 4


def test_suffix_min_token_prob_and_max_spec_factor_limit_the_draft():
    outputs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [1, 2, 7, 7, 7, 7]]
    for min_prob, factor, want in [(0.1, 2.0, [3, 4, 5, 6]),  # 3 (2/3), 4 (2/3 × 1/2 = 1/3), 5, 6: factor 2 × 2
                                   (0.5, 2.0, [3]),  # 4 would be 1/3 < 0.5
                                   (0.7, 2.0, []),  # 3 is only 2/3
                                   (0.1, 1.0, [3, 4]),  # floor(1.0 × 2)
                                   (0.1, 0.75, [3])]:  # floor(0.75 × 2)
        proposer = suffix(cached=5, factor=factor, min_prob=min_prob)
        for i, output in enumerate(outputs):
            proposer.add(str(i), [0])
            proposer.extend(str(i), output)
            proposer.remove(str(i))
        proposer.add("r", [8, 1, 2])
        assert proposer.propose("r", 8) == want, (min_prob, factor)


def test_suffix_evicts_the_oldest_cached_request_fully():
    proposer = suffix(depth=4, cached=2)
    for i, output in enumerate([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10]]):
        proposer.add(str(i), [0])
        proposer.extend(str(i), output)
        proposer.remove(str(i))
    proposer.add("a", [1, 2])
    assert proposer.propose("a", 4) == []  # [1, 2, 3, 4] left the cache
    proposer.add("b", [5, 6])
    assert proposer.propose("b", 4) == [7]
    fresh = suffix(depth=4, cached=2)
    for i, output in enumerate([[5, 6, 7], [8, 9, 10]]):
        fresh.add(str(i), [0])
        fresh.extend(str(i), output)
        fresh.remove(str(i))
    assert fresh.work(2) and fresh.work(10) is False  # (the cache's inserts wait for a proposal or work())
    assert trie_nodes(proposer._global) == trie_nodes(fresh._global)  # its counts and nodes are gone


def test_suffix_cache_work_comes_in_chunks():
    """An ended request's outputs go into the global trie, and an evicted one's out, a few tokens a work() call
    (what the engine does while it waits for the device), never all at once."""
    proposer, fresh = suffix(depth=4, cached=1), suffix(depth=4, cached=1)
    for p in (proposer, fresh):
        for i, output in enumerate([[1, 2, 3, 4, 5, 6], [7, 8, 9, 7, 8, 9]]):
            p.add(str(i), [0])
            p.extend(str(i), output)
            p.remove(str(i))
    calls = 0
    while proposer.work(2):
        calls += 1
    assert calls + 1 == (6 + 6 + 6) // 2  # (in, in, the first out: 2 tokens a call)
    fresh.add("x", [7, 8])
    assert fresh.propose("x", 4) == [9, 7]  # (a proposal does what waits at once)
    assert trie_nodes(proposer._global) == trie_nodes(fresh._global)


def trie_nodes(trie) -> dict[tuple[int, ...], int]:
    """Every live node's string → its count (the edges walked from the root)."""
    out, todo = {(): trie.count[0]}, [(0, ())]
    while todo:
        node, text = todo.pop()
        child = trie.first_child[node]
        while child != -1:
            out[text + (trie.token[child],)] = trie.count[child]
            todo.append((child, text + (trie.token[child],)))
            child = trie.next_sibling[child]
    return out


@pytest.mark.parametrize("seed", range(25))
def test_suffix_matches_the_rescan(seed):
    """Requests started, extended in chunks and ended (cached or not) at random over a small vocabulary."""
    rng = random.Random(seed)
    depth, max_cached, vocab = rng.randint(2, 6), rng.randint(1, 3), rng.randint(2, 4)
    factor, min_prob, k = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3]), rng.randint(1, 8)
    proposer, cached, live, prompt_len = suffix(depth, max_cached, factor, min_prob), [], {}, {}
    for step in range(120):
        if len(live) < 3 and rng.random() < 0.3:
            rid = f"r{step}"
            live[rid] = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            prompt_len[rid] = len(live[rid])
            proposer.add(rid, live[rid])
        elif live and rng.random() < 0.1:
            rid = rng.choice(sorted(live))
            keep, outputs = rng.random() < 0.8, live.pop(rid)[prompt_len[rid]:]
            proposer.remove(rid, keep_outputs=keep)
            cached = (cached + [outputs])[-max_cached:] if keep and outputs else cached
        for rid in sorted(live):
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            proposer.extend(rid, new)
            live[rid] += new
            if rng.random() < 0.3:  # (what the engine does while it waits: drafts must not depend on it)
                proposer.work(rng.randint(1, 4))
            if rng.random() < 0.6:  # (else its tokens wait to be indexed by a later proposal)
                assert proposer.propose(rid, k) == suffix_oracle(live[rid], cached, depth, k, factor, min_prob)
    want = Counter()
    for seq in cached:
        want.update(tuple(seq[i:j]) for i in range(len(seq)) for j in range(i + 1, min(i + depth, len(seq)) + 1))
    want[()] = sum(map(len, cached))
    while proposer.work(3):
        pass
    assert trie_nodes(proposer._global) == dict(want) and not proposer._unindexed


@pytest.mark.parametrize("seed", range(6))
def test_sequence_trie_drafts_equal_the_full_trie_s(seed):
    """A request's own trie leaves the strings seen once unmade (SequenceTrie): from every suffix of a random
    sequence over a small vocabulary, after every token, its drafts equal those of the trie that makes every node."""
    rng = random.Random(seed)
    for _ in range(60):
        depth, vocab, tokens = rng.randint(1, 6), rng.randint(1, 4), []
        full, compact = SuffixTrie(depth), SequenceTrie(depth, tokens)
        full_suffixes, made = [ROOT], [ROOT]
        for _ in range(rng.randint(1, 40)):
            tokens.append(rng.randrange(vocab))
            full_suffixes, made = full.insert(full_suffixes, tokens[-1]), compact.insert(made)
            for m in range(1, len(full_suffixes)):  # (a suffix not made is the leaf of its one occurrence)
                node = made[m] if m < len(made) else -2 - (len(tokens) - 1)
                if m < len(made):
                    assert compact.first_prob(node) == full.first_prob(full_suffixes[m])
                for limit, min_prob in ((1, 0.0), (3, 0.3), (20, 0.0)):
                    want = full.draft(full_suffixes[m], m, limit, min_prob)
                    assert compact.draft(node, m, limit, min_prob) == want


def test_suffix_is_deterministic_and_extend_chunking_does_not_matter():
    rng = random.Random(3)
    stream = [rng.randrange(5) for _ in range(200)]
    runs = []
    for chunked in (False, True, True):
        proposer, got, at = suffix(depth=8), [], 5
        proposer.add("r", stream[:5])
        while at < len(stream):
            step = rng.randint(1, 4) if chunked else 1
            proposer.extend("r", stream[at:at + step])
            at += step
            got.append((at, proposer.propose("r", 6)))
        runs.append(dict(got))
    common = set(runs[0]) & set(runs[1]) & set(runs[2])
    assert common and all(runs[0][at] == runs[1][at] == runs[2][at] for at in common)


# ---- the interface -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, want", [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, [2, 1]),
    ({"method": "suffix"}, [2])])  # "1" then 2 at 1/2, then 1 at 1/2: floor(1.0 × 1) = 1 token
def test_make_proposer_and_unknown_requests(config, want):
    proposer = make_proposer(SpeculativeConfig.parse(config))
    assert proposer.method == config["method"]
    with pytest.raises(KeyError, match="unknown request 'x'"):
        proposer.extend("x", [1])
    with pytest.raises(KeyError, match="unknown request 'x'"):
        proposer.propose("x", 2)
    proposer.add("x", [1, 2, 1])
    with pytest.raises(ValueError, match="already added"):
        proposer.add("x", [1])
    assert proposer.propose("x", 2) == want
    proposer.remove("x")
    with pytest.raises(KeyError):
        proposer.remove("x")


def test_speed_on_a_long_request(capsys):
    """Not a timed assertion: 10k steps (extend one token, propose 8) on a 4k-token request finish quickly."""
    rng = random.Random(0)
    prompt = [rng.randrange(200) for _ in range(4096)]
    for config in ({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
                   {"method": "suffix"}):
        proposer = make_proposer(SpeculativeConfig.parse(config))
        start = time.perf_counter()
        proposer.add("r", prompt)
        proposer.propose("r", 8)  # (suffix indexes the prompt here)
        added = time.perf_counter()
        for step in range(10_000):
            at = rng.randrange(len(prompt) - 50) if step % 40 == 0 else at + 1  # copy spans of the prompt
            proposer.extend("r", [prompt[at]])
            proposer.propose("r", 8)
        done = time.perf_counter()
        with capsys.disabled():
            print(f"\n{config['method']}: add 4096 tokens + propose {1e3 * (added - start):.1f} ms, "
                  f"extend(1) + propose(8) {1e6 * (done - added) / 10_000:.1f} µs a step")
