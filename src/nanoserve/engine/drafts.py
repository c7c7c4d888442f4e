"""drafts: the host-side draft proposers of speculative decoding (speculative_config's "ngram" and "suffix").

The engine keeps one Proposer and calls it for every decoding sequence every step: add() when a request starts,
extend() with the tokens it appended, propose() for up to k drafts, remove() when it ends. Drafts are a
deterministic function of the tokens seen (ties broken by the smallest token id), so verification is exact
(speculative_config says why). Every call costs O(new tokens × lookup depth) or O(k + depth) (suffix: its tokens
are indexed when drafts are next asked for, SuffixProposer._index): nothing rescans a request's history, since this
runs on the engine loop for every sequence of every step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

from nanoserve.engine.suffix_trie import ROOT as _ROOT, SequenceTrie, SuffixTrie
from nanoserve.speculative_config import SpeculativeConfig

_FLOOR_SLACK = 1e-6  # floor(factor × matched length) without losing 29 to 0.29 × 100 = 28.999…
_TIE = 1e-9  # draft scores this close are a tie (rounding must not pick the winner)


class Proposer(ABC):
    """The interface the engine calls; one object per engine holds every running request's index."""
    method = ""

    def __init__(self):
        self._requests: dict[str, object] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """A request starts: index its prompt."""
        if request_id in self._requests:
            raise ValueError(f"drafts: request {request_id!r} was already added")
        self._requests[request_id] = state = self._new_state(prompt_token_ids)
        self._append(state, prompt_token_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens the request appended (its outputs: 1..k+1 a step)."""
        self._append(self._state(request_id), token_ids)

    def propose(self, request_id: str, k: int) -> list[int]:
        """At most k draft ids continuing the request's tokens ([] when nothing matches)."""
        state = self._state(request_id)
        return self._propose(state, k) if k > 0 else []

    def remove(self, request_id: str, keep_outputs: bool = True) -> None:
        """The request ended: drop its index (suffix: its outputs join the global cache when keep_outputs)."""
        state = self._state(request_id)
        del self._requests[request_id]
        self._ended(state, keep_outputs)

    def work(self, budget: int) -> bool:
        """Index up to about `budget` tokens whose indexing was deferred (the engine calls it while it waits for the
        device); True when more wait. Proposals index whatever still waits first, so drafts do not depend on it."""
        return False

    def _state(self, request_id: str):
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"drafts: unknown request {request_id!r} (never added, or already removed)") from None

    @abstractmethod
    def _new_state(self, prompt_token_ids: Sequence[int]):
        """Each proposer's own index (NgramProposer, SuffixProposer)."""

    @abstractmethod
    def _append(self, state, token_ids: Sequence[int]) -> None:
        """Each proposer's own index (NgramProposer, SuffixProposer)."""

    @abstractmethod
    def _propose(self, state, k: int) -> list[int]:
        """Each proposer's own index (NgramProposer, SuffixProposer)."""

    def _ended(self, state, keep_outputs: bool) -> None:
        """What a method keeps of an ended request (nothing, unless it says)."""


class _NgramState:
    __slots__ = ("tokens", "last_end")

    def __init__(self, num_sizes: int):
        self.tokens: list[int] = []
        # last_end[n - min][ngram] = where the continuation of its most recent occurrence starts, over every
        # occurrence but the request's suffix itself (an n-gram is indexed once a token follows it)
        self.last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_sizes)]


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's "ngram"): for n from prompt_lookup_max down to prompt_lookup_min, when the last n
    tokens occurred earlier in the request (prompt + outputs), propose the up to k tokens that followed their most
    recent earlier occurrence (best for copying and editing), up to the last known token; the longest n wins.

    Each n-gram is indexed (a dict per n, n-gram tuple → end of its latest occurrence) when the token after it
    arrives, so the request's suffix never matches itself: a token costs O(Σ n) and propose() O(Σ n + k)."""
    method = "ngram"

    def __init__(self, lookup_min: int, lookup_max: int):
        super().__init__()
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"drafts: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lookup_min}, "
                             f"{lookup_max}")
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def _new_state(self, prompt_token_ids: Sequence[int]) -> _NgramState:
        return _NgramState(self.lookup_max - self.lookup_min + 1)

    def _append(self, state: _NgramState, token_ids: Sequence[int]) -> None:
        tokens, last_end, lo = state.tokens, state.last_end, self.lookup_min
        for token in token_ids:
            end = len(tokens)  # the n-grams ending here get a continuation: index them
            for n, index in enumerate(last_end, lo):
                if n > end:
                    break
                index[tuple(tokens[end - n:end])] = end
            tokens.append(token)

    def _propose(self, state: _NgramState, k: int) -> list[int]:
        tokens, size = state.tokens, len(state.tokens)
        for n in range(min(self.lookup_max, size - 1), self.lookup_min - 1, -1):
            start = state.last_end[n - self.lookup_min].get(tuple(tokens[size - n:]))
            if start is not None:
                return tokens[start:min(start + k, size)]
        return []


class _SuffixState:
    __slots__ = ("tokens", "num_indexed", "num_prompt", "trie", "suffixes", "global_node", "global_depth",
                 "global_version")

    def __init__(self, num_prompt: int, depth: int, global_version: int):
        self.tokens: list[int] = []
        self.num_indexed = 0  # its leading tokens in its trie; the rest wait for its next proposal
        self.num_prompt = num_prompt
        self.trie = SequenceTrie(depth, self.tokens)  # the request's prompt + outputs
        self.suffixes = [_ROOT]  # its suffixes' made nodes in its trie, by length 0.. (longer ones are leaves)
        # its longest suffix in the global trie, valid while the cache is at that version
        self.global_node, self.global_depth, self.global_version = _ROOT, 0, global_version


class SuffixProposer(Proposer):
    """Suffix decoding (vLLM's / Arctic Inference's "suffix"): a trie of the request's prompt + outputs and a
    global trie of the outputs of the suffix_decoding_max_cached_requests requests that ended last (FIFO: the
    oldest one's counts and nodes leave when one more arrives), both of depth suffix_decoding_max_tree_depth.

    Every suffix x of the request's tokens (|x| < depth) found in a trie is a match; its draft (SuffixTrie.draft)
    has ≤ min(k, floor(max_spec_factor × |x|)) tokens and a score (Σ of the path probabilities). The request's
    own trie counts x's current occurrence too, which has no continuation, so x never predicts itself and the
    estimates are count(x t) / count(x) over every occurrence. Rule (Arctic Inference's): the draft of the highest
    score over both tries and every match length; ties go to the request's own trie, then to the longer match.
    Not only the longest match: in the own trie that one's continuation ends where the current occurrence begins
    (one token for a loop "a a a …"), which a shorter match sees past. Unlike Arctic Inference, a draft that
    reaches the depth goes on from its context less the first token (match + draft may exceed the depth).

    Memory: ≤ depth nodes per indexed token of the outputs of at most max_cached_requests ended requests (an
    evicted one's nodes are freed for reuse), and for each running request's prompt + outputs a node per string
    seen twice or more (SequenceTrie; freed with it). The request's match in the global trie walks on with each
    indexed token (amortized O(1)); when the cache changes it is recomputed from the last depth tokens at the next
    propose."""
    method = "suffix"

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float):
        super().__init__()
        if max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError(f"drafts: need max_tree_depth >= 1 and max_cached_requests >= 0, got "
                             f"{max_tree_depth}, {max_cached_requests}")
        self.depth, self.max_cached_requests = max_tree_depth, max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self._global = SuffixTrie(max_tree_depth)
        self._cached: deque[list[int]] = deque()  # the indexed outputs, oldest first
        self._arriving: deque[list] = deque()  # ended requests' outputs on their way in: [outputs, inserted, suffixes]
        self._leaving: deque[list] = deque()  # evicted outputs on their way out: [outputs, strings removed]
        self._unindexed: dict[_SuffixState, None] = {}  # live requests with tokens to index, in order
        self._version = 0  # bumped when the global trie changes

    def _new_state(self, prompt_token_ids: Sequence[int]) -> _SuffixState:
        return _SuffixState(len(prompt_token_ids), self.depth, self._version)

    def _append(self, state: _SuffixState, token_ids: Sequence[int]) -> None:
        state.tokens.extend(token_ids)  # (indexed by its next proposal, or while the engine waits: _index, work)
        self._unindexed[state] = None

    def _index(self, state: _SuffixState, limit: int | None = None) -> int:
        """Index (up to `limit` of) the tokens appended since the request's last proposal → how many: a backed-off
        request (engine/speculation.py) is asked only now and then, and a few tokens at once cost less than one a
        step on the loop's cold caches."""
        tokens, start = state.tokens, state.num_indexed
        stop = len(tokens) if limit is None else min(len(tokens), start + limit)
        trie, walk, suffixes = state.trie, self._global.walk, state.suffixes
        walking = state.global_version == self._version and bool(self._cached)
        node, depth = state.global_node, state.global_depth
        for token in tokens[start:stop]:
            suffixes = trie.insert(suffixes)
            if walking:
                node, depth = walk(node, depth, token)
        state.num_indexed = stop
        state.suffixes, state.global_node, state.global_depth = suffixes, node, depth
        if stop == len(tokens):
            self._unindexed.pop(state, None)
        return stop - start

    def _propose(self, state: _SuffixState, k: int) -> list[int]:
        self._cache()
        self._index(state)
        top = min(len(state.suffixes), self.depth) - 1
        found = self._search(state.trie, state.suffixes[top], top, k, ([], 0.0))
        if self._cached:
            found = self._search(self._global, *self._global_match(state), k, found)
        return found[0]

    def _global_match(self, state: _SuffixState) -> tuple[int, int]:
        """The node (and depth < the trie's) of the request's longest suffix in the global trie."""
        trie = self._global
        if state.global_version != self._version:
            node, depth = _ROOT, 0
            for token in state.tokens[-self.depth:]:
                node, depth = trie.walk(node, depth, token)
            state.global_node, state.global_depth, state.global_version = node, depth, self._version
        if state.global_depth == self.depth:
            return trie.link[state.global_node], self.depth - 1
        return state.global_node, state.global_depth

    def _search(self, trie: SuffixTrie | SequenceTrie, node: int, depth: int, k: int,
                found: tuple[list[int], float]) -> tuple[list[int], float]:
        """The draft of the highest score over the matches from (node, depth) down its suffix links, or found
        when none beats it by more than _TIE. A match of length m drafts ≤ limit = min(k, floor(factor × m))
        tokens, each at most as likely as its first (p1), so limit × p1 bounds its score: matches that cannot
        win are skipped, and the walk ends once the limit alone cannot."""
        while node != _ROOT:
            limit = min(k, int(self.max_spec_factor * depth + _FLOOR_SLACK))
            if limit <= found[1] + _TIE / 2:
                break
            first = trie.first_prob(node)
            if first and limit * first > found[1] + _TIE / 2:
                draft = trie.draft(node, depth, limit, self.min_token_prob)
                if draft[1] > found[1] + _TIE:
                    found = draft
            node, depth = trie.link[node], depth - 1
        return found

    def _ended(self, state: _SuffixState, keep_outputs: bool) -> None:
        self._unindexed.pop(state, None)
        outputs = state.tokens[state.num_prompt:]
        if keep_outputs and outputs and self.max_cached_requests > 0:
            self._arriving.append([outputs, 0, [_ROOT]])  # (into the global trie: _cache)

    def work(self, budget: int) -> bool:
        for state in list(self._unindexed)[:budget]:
            budget -= self._index(state, budget)
            if budget <= 0:
                break
        if budget > 0:
            self._cache(budget)
        return bool(self._unindexed or self._arriving or self._leaving)

    def _cache(self, budget: int | None = None) -> None:
        """Up to `budget` tokens (None: all) of the global trie's waiting work, oldest first: an evicted output's
        strings out, then the ended requests' outputs in (one fully in evicts the oldest cached one beyond
        max_cached_requests)."""
        while (self._leaving or self._arriving) and (budget is None or budget > 0):
            item = self._leaving[0] if self._leaving else self._arriving[0]
            tokens, at = item[0], item[1]
            stop = len(tokens) if budget is None else min(len(tokens), at + budget)
            if self._leaving:
                self._global.remove(tokens, range(at, stop))
                item[1] = stop
            else:
                suffixes = item[2]
                for token in tokens[at:stop]:
                    suffixes = self._global.insert(suffixes, token)
                item[1:] = stop, suffixes
            budget = None if budget is None else budget - (stop - at)
            self._version += 1
            if stop < len(tokens):
                continue
            if self._leaving:
                self._leaving.popleft()
                continue
            self._cached.append(self._arriving.popleft()[0])
            if len(self._cached) > self.max_cached_requests:
                self._leaving.append([self._cached.popleft(), 0])


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    """The proposer of the checked settings' method."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                              spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)
    raise ValueError(f"drafts: unknown speculative method {spec.method!r}")


__all__ = ["Proposer", "NgramProposer", "SuffixProposer", "make_proposer"]
