"""StopMatcher: all of a request's stop strings in one Aho–Corasick automaton, so finding them costs the same
per character of output whatever their number and length (the front end runs it for every delta of every
stream, on the API process's event loop).

A completion keeps one state, an int. Feeding it the new text finds the first stop string that ends in it
(the longest of those ending at the same character, so the earliest start) and leaves in the state how many
trailing characters could still begin a stop string: those are held back from streamed text until they
cannot. One automaton serves every completion and request with the same stop strings while any holds it.
"""
from __future__ import annotations

import threading
import weakref
from array import array
from collections.abc import Sequence

_SHIFT = 21  # a transition's key is node << 21 | ord(character): Unicode code points fit in 21 bits
_cache: weakref.WeakValueDictionary[tuple[str, ...], StopMatcher] = weakref.WeakValueDictionary()
_cache_lock = threading.Lock()


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        """The trie of the stop strings, then its failure links breadth-first (a node's fallback is the longest
        proper suffix of its text that is also in the trie)."""
        self.stops = tuple(stops)
        goto: dict[int, int] = {}
        depth, match = array("l", [0]), array("l", [-1])  # match: the longest stop string ending at the node
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                key = node << _SHIFT | ord(ch)
                child = goto.get(key)
                if child is None:
                    child = goto[key] = len(depth)
                    depth.append(depth[node] + 1)
                    match.append(-1)
                node = child
            if match[node] == -1:
                match[node] = index
        fail = array("l", bytes(8 * len(depth)))
        by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
        for key in goto:
            by_depth[depth[goto[key]]].append(key)
        mask = (1 << _SHIFT) - 1
        for keys in by_depth[2:]:  # depth 1 falls back to the root (0)
            for key in keys:
                child, code, f = goto[key], key & mask, fail[key >> _SHIFT]
                while (nxt := goto.get(f << _SHIFT | code)) is None and f:
                    f = fail[f]
                fail[child] = nxt or 0
                if match[child] == -1:
                    match[child] = match[fail[child]]
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match

    @classmethod
    def of(cls, stops: Sequence[str]) -> StopMatcher:
        """The automaton of these stop strings, shared with whoever holds one for the same list."""
        key = tuple(stops)
        with _cache_lock:
            matcher = _cache.get(key)
        if matcher is None:
            matcher = cls(key)
            with _cache_lock:
                matcher = _cache.setdefault(key, matcher)
        return matcher

    def feed(self, state: int, text: str, start: int = 0) -> tuple[int, int, str | None]:
        """Advance `state` over text[start:]: (state, end, stop) at the first stop string that ends there,
        else (state after the text, len(text), None)."""
        goto, fail, match, shift = self._goto, self._fail, self._match, _SHIFT
        for i in range(start, len(text)):
            code = ord(text[i])
            while (nxt := goto.get(state << shift | code)) is None and state:
                state = fail[state]
            state = nxt or 0
            if match[state] >= 0:
                return state, i + 1, self.stops[match[state]]
        return state, len(text), None

    def held_back(self, state: int) -> int:
        """Characters at the end of the text fed so far that could still begin a stop string."""
        return self._depth[state]
