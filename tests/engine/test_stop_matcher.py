"""StopMatcher (issue 17, case 2): one Aho–Corasick automaton over all stop strings gives what scanning every
stop string at every delta gave (the first stop string to end, the held-back tail), fed in any chunking, and
its cost per character does not grow with the number of stop strings."""
from __future__ import annotations

import random
import time

import pytest

from nanoserve.engine.stop_matcher import StopMatcher


def first_end(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: (end, stop) of the stop string that ends first, the longest of those ending there."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.endswith(s, 0, end)]
        if done:
            return end, max(done, key=len)
    return None


def held(text: str, stops: list[str]) -> int:
    """Brute force: the longest tail of text that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_brute_force_in_any_chunking(seed):
    rng = random.Random(seed)
    alphabet = "ab c\u00e9\U0001f600"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
    text = "".join(rng.choice(alphabet) for _ in range(40))
    matcher = StopMatcher(stops)
    want = first_end(text, stops)
    state, pos, fed, got = 0, 0, 0, None
    while fed < len(text) and got is None:
        fed = min(len(text), fed + rng.randint(1, 4))  # a token's worth of new characters
        state, pos, stop = matcher.feed(state, text[:fed], pos)
        if stop is not None:
            got = (pos, stop)
        else:
            assert matcher.held_back(state) == held(text[:fed], stops), (stops, text[:fed])
    assert got == want, (stops, text)


def test_shared_while_held_and_duplicates_are_one():
    a = StopMatcher.of(["x", "yz", "x"])
    assert StopMatcher.of(("x", "yz", "x")) is a
    assert a.feed(0, "..yz")[1:] == (4, "yz") and a.feed(0, "x")[1:] == (1, "x")


def test_cost_per_character_does_not_grow_with_the_stop_strings():
    """1,000 stop strings of 200 characters cost about what 4 do, per character fed."""
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(20_000))

    def per_char(matcher) -> float:
        start = time.perf_counter()
        matcher.feed(0, text)
        return (time.perf_counter() - start) / len(text)

    few = StopMatcher(["".join(rng.choice("abcdefgh") for _ in range(20)) for _ in range(4)])
    many = StopMatcher(["".join(rng.choice("abcdefgh ") for _ in range(200)) + "!" for _ in range(1000)])
    assert min(per_char(many) for _ in range(3)) < 10 * min(per_char(few) for _ in range(3)) + 2e-6
