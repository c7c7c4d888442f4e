"""SuffixTrie: the counted trie of token strings behind the suffix proposer (engine/drafts.py), in flat lists."""
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

    def __init__(self, depth: int, evictable: bool):
        self.depth, self.evictable = depth, evictable
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
        evictable, link = self.evictable, self.link
        for node in suffixes[at:]:
            if evictable:
                child = self._new_node(node, token, grown[-1])
            else:  # (a request's own trie: nodes are only appended)
                child = len(count)
                count.append(1)
                tok.append(token)
                best.append(NONE)
                link.append(grown[-1])
                edges[node << SHIFT | token] = child
            top = best[node]
            if top == NONE or (count[top] == 1 and tok[top] > token):
                best[node] = child
            grown.append(child)
        return grown

    def _new_node(self, parent: int, token: int, link: int) -> int:
        """A child of parent for token, counted once, in an evictable trie (a node freed before is reused)."""
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

    def remove(self, tokens: Sequence[int]) -> None:
        """Un-index a sequence inserted before: its counts go, and the nodes no other sequence holds."""
        for start in range(len(tokens)):
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


__all__ = ["SuffixTrie", "ROOT", "NONE", "SHIFT"]
