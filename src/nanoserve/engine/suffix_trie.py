"""The counted tries of token strings behind the suffix proposer (engine/drafts.py), in flat lists: SuffixTrie (any
sequences, evictable: the global cache) and SequenceTrie (one growing sequence: a request's own)."""
from __future__ import annotations

from collections.abc import Sequence

SHIFT = 32  # a trie edge's key is node << 32 | token: token ids fit in 32 bits
ROOT = 0
NONE = -1  # no node (no best child, no sibling)


class SuffixTrie:
    """Every token string of length ≤ depth in the indexed sequences, with its number of occurrences: node = a
    string, its children = the tokens that followed it. Insertion keeps the nodes of the sequence's suffixes
    (≤ depth of them), so a token costs O(depth) and adds at most depth nodes: memory is ≤ depth nodes per indexed
    token (fewer where strings repeat), held in flat lists plus one dict of edges.

    Each node keeps its most frequent child (ties: the smallest token id) for O(1) drafting, and its suffix link
    (the node of its string without the first token), which exists since every substring of an indexed string is
    indexed: it lets a match walk on like Aho–Corasick and a draft run past the depth."""

    def __init__(self, depth: int):
        self.depth = depth
        self.edges: dict[int, int] = {}
        # per node (the root is 0): occurrences, last token, most frequent child, suffix link; lists index fastest
        self.count, self.token, self.best, self.link = [0], [0], [NONE], [ROOT]
        # what remove() needs: each node's children as a doubly linked list, and the ids it freed
        self.first_child, self.next_sibling, self.prev_sibling = [NONE], [NONE], [NONE]
        self.free: list[int] = []

    def insert(self, suffixes: list[int], token: int) -> list[int]:
        """Index token after the sequence whose suffix nodes (depth 0 first) are given → the new suffix nodes. Once
        a suffix + token is new, every longer one is (it contains the shorter): those are made without a lookup."""
        count, best, tok, edges = self.count, self.best, self.token, self.edges
        count[ROOT] += 1
        grown = [ROOT]
        suffixes = suffixes[:self.depth]
        for at, node in enumerate(suffixes):
            child = edges.get(node << SHIFT | token)
            if child is None:
                break
            count[child] += 1
            top = best[node]
            if top != child and (count[child] > count[top] or (count[child] == count[top] and tok[child] < tok[top])):
                best[node] = child
            grown.append(child)
        else:
            return grown
        for node in suffixes[at:]:
            child = self._new_node(node, token, grown[-1])
            top = best[node]
            if top == NONE or (count[top] == 1 and tok[top] > token):
                best[node] = child
            grown.append(child)
        return grown

    def _new_node(self, parent: int, token: int, link: int) -> int:
        """A child of parent for token, counted once (a node freed before is reused)."""
        if self.free:
            node = self.free.pop()
            self.count[node], self.token[node], self.best[node], self.link[node] = 1, token, NONE, link
        else:
            node = len(self.count)
            self.count.append(1)
            self.token.append(token)
            self.best.append(NONE)
            self.link.append(link)
            self.first_child.append(NONE)
            self.next_sibling.append(NONE)
            self.prev_sibling.append(NONE)
        head = self.first_child[parent]
        self.first_child[node], self.next_sibling[node], self.prev_sibling[node] = NONE, head, NONE
        self.first_child[parent] = node
        if head != NONE:
            self.prev_sibling[head] = node
        self.edges[parent << SHIFT | token] = node
        return node

    def remove(self, tokens: Sequence[int], starts: range | None = None) -> None:
        """Un-index a sequence inserted before (its strings from `starts`, default all): its counts go, and the nodes
        no other sequence holds."""
        for start in range(len(tokens)) if starts is None else starts:
            path = [ROOT]
            for token in tokens[start:start + self.depth]:
                path.append(self.edges[path[-1] << SHIFT | token])
            self.count[ROOT] -= 1
            for at in range(len(path) - 1, 0, -1):  # deepest first: a node's children are gone before it
                self._decrement(path[at - 1], path[at])

    def _decrement(self, parent: int, node: int) -> None:
        self.count[node] -= 1
        if self.count[node] == 0:
            before, after = self.prev_sibling[node], self.next_sibling[node]
            if before == NONE:
                self.first_child[parent] = after
            else:
                self.next_sibling[before] = after
            if after != NONE:
                self.prev_sibling[after] = before
            del self.edges[parent << SHIFT | self.token[node]]
            self.free.append(node)
        if self.best[parent] == node:
            self.best[parent] = self._most_frequent_child(parent)

    def _most_frequent_child(self, node: int) -> int:
        top, child = NONE, self.first_child[node]
        count, tok = self.count, self.token
        while child != NONE:
            if top == NONE or count[child] > count[top] or (count[child] == count[top] and tok[child] < tok[top]):
                top = child
            child = self.next_sibling[child]
        return top

    def first_prob(self, node: int) -> float:
        """count(best child) / count(node) (0: no child)."""
        top = self.best[node]
        return 0.0 if top == NONE else self.count[top] / self.count[node]

    def walk(self, node: int, depth: int, token: int) -> tuple[int, int]:
        """The node (and depth) of the longest suffix present after token follows the string of node."""
        while True:
            if depth < self.depth:
                child = self.edges.get(node << SHIFT | token)
                if child is not None:
                    return child, depth + 1
            if node == ROOT:
                return ROOT, 0
            node, depth = self.link[node], depth - 1

    def draft(self, node: int, depth: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent child while the product of count(child) / count(node) along the path stays
        ≥ min_prob, for ≤ limit tokens; at the depth, drop the context's first token (the suffix link) to go on.
        → (tokens, score = Σ of those products, the expected number accepted were the estimates right)."""
        count, best, tok, link = self.count, self.best, self.token, self.link
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if depth == self.depth:
                node, depth = link[node], depth - 1
            child = best[node]
            if child == NONE:
                break
            prob *= count[child] / count[node]
            if prob < min_prob:
                break
            out.append(tok[child])
            score += prob
            node, depth = child, depth + 1
        return out, score


class SequenceTrie:
    """SuffixTrie's counts and drafts for one growing sequence (a request's prompt + outputs), without making the
    strings that occur once: such a string hangs from its longest prefix that occurs more often as a leaf, -2 - the
    position of its last token (its one occurrence), and its longer strings follow the sequence from there. On new
    text a token then makes no node (its suffixes' strings + it are leaves or inside leaves) instead of ~depth; a
    leaf's string seen again is made then (count 2), the old occurrence's next token a leaf below it. Made nodes are
    the strings seen at least twice (and the root); their suffix links are made too."""

    def __init__(self, depth: int, tokens: list[int]):
        """tokens: the sequence (appended to by its owner); its first `length` are indexed."""
        self.depth, self.tokens, self.length = depth, tokens, 0
        self.edges: dict[int, int] = {}
        self.count, self.token, self.best, self.link = [0], [0], [NONE], [ROOT]

    def _count(self, ref: int) -> int:
        return self.count[ref] if ref >= 0 else 1

    def _token(self, ref: int) -> int:
        return self.token[ref] if ref >= 0 else self.tokens[-2 - ref]

    def insert(self, suffixes: list[int]) -> list[int]:
        """Index the sequence's next token after its suffixes' made nodes (length 0 first) → the new ones."""
        i = self.length
        token, self.length = self.tokens[i], i + 1
        count, best, tok, edges = self.count, self.best, self.token, self.edges
        count[ROOT] += 1
        grown = [ROOT]
        suffixes = suffixes[:self.depth]
        for at, node in enumerate(suffixes):
            key = node << SHIFT | token
            child = edges.get(key)
            if child is None:
                break
            if child < 0:
                child = self._make(node, key, child, token, grown[-1], len(grown))
            else:
                count[child] += 1
            top = best[node]
            if top != child and (count[child] > self._count(top)
                                 or (count[child] == self._count(top) and tok[child] < self._token(top))):
                best[node] = child
            grown.append(child)
        else:
            return grown
        leaf = -2 - i  # node + token is new, and so is every longer suffix + token (it contains this one): leaves
        for node in suffixes[at:]:
            edges[node << SHIFT | token] = leaf
            top = best[node]
            if top == NONE or (self._count(top) == 1 and self._token(top) > token):
                best[node] = leaf
        return grown

    def _make(self, parent: int, key: int, leaf: int, token: int, link: int, depth: int) -> int:
        """The leaf's string, seen a second time: a made node of count 2 (at `depth`), whose child is the leaf of the
        old occurrence's next token (its string occurs once: the new occurrence's next token is not there yet)."""
        node = len(self.count)
        self.count.append(2)
        self.token.append(token)
        self.best.append(NONE)
        self.link.append(link)
        self.edges[key] = node
        if self.best[parent] == leaf:
            self.best[parent] = node
        after = -2 - leaf + 1  # (≤ the position being indexed)
        if depth < self.depth:
            self.edges[node << SHIFT | self.tokens[after]] = self.best[node] = -2 - after
        return node

    def first_prob(self, node: int) -> float:
        """count(best child) / count(node) of a made node (0: no child)."""
        top = self.best[node]
        return 0.0 if top == NONE else self._count(top) / self.count[node]

    def _linked(self, ref: int, depth: int) -> int:
        """The suffix link of a leaf's string at `depth` (a leaf has none stored: found from the root along the
        sequence)."""
        end = -2 - ref
        node = ROOT
        for at in range(end - depth + 2, end + 1):
            node = self.edges[node << SHIFT | self.tokens[at]]
            if node < 0:  # (inside a leaf: its one occurrence is this one, up to end)
                return -2 - end
        return node

    def draft(self, node: int, depth: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """SuffixTrie.draft over made nodes and leaves (a leaf's string continues with the sequence's next token at
        probability 1, while the sequence is indexed that far)."""
        count, best, tok, link, tokens = self.count, self.best, self.token, self.link, self.tokens
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if depth == self.depth:
                node, depth = (link[node] if node >= 0 else self._linked(node, depth)), depth - 1
            if node >= 0:
                child = best[node]
                if child >= 0:
                    prob *= count[child] / count[node]
                    token = tok[child]
                elif child == NONE:
                    break
                else:
                    prob *= 1 / count[node]
                    token = tokens[-2 - child]
            else:  # (inside a leaf: its one occurrence goes on)
                after = -1 - node
                if after >= self.length:
                    break
                child, token = -2 - after, tokens[after]
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node, depth = child, depth + 1
        return out, score


__all__ = ["SuffixTrie", "SequenceTrie", "ROOT", "NONE", "SHIFT"]
