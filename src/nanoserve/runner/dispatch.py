"""The one table that maps a step to its graph (vLLM V1's dispatcher): a step's kind and size (decode rows, prompt /
mixed tokens, the rows a decode graph's sampler samples) → the captured size that runs it, or None (eager).

Decode and token-count steps replay the smallest captured size of at least their rows / tokens (the rest is
padding); the sampler's graphs are captured per decode bucket and replay exactly the bucket the decode graph
replayed. A kind without graphs, a step over the largest size, or a step whose inputs do not fit the static buffers
runs eagerly. The start-up self-check walks the same table (entries()), and a new graph kind is one more Kind here:
a draft model's decode steps (DRAFT) record its k forwards too, so a step that proposes nothing replays DECODE and
does not pay for them; a step verifying n-gram / suffix drafts (VERIFY) reads each sequence's rows as one attention
group, whose wider query tile plain rows would pay for (attention ~4% a layer at b = 32), so plain steps replay DECODE.
"""
from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator

import torch

from nanoserve.runner.cuda_graph import GraphRunner


class Kind(enum.Enum):
    DECODE = "decode"  # a decode step of b rows: batch-size graphs
    VERIFY = "verify"  # a decode step whose sequences verify drafts (runs of 1 + k rows, read as attention groups)
    DRAFT = "draft"  # a decode step whose drafts a draft model proposes (runner/draft_model.py): the same sizes
    TOKENS = "tokens"  # a prompt / mixed step of t tokens: token-count graphs
    SAMPLE = "sample"  # the plain sample of a decode bucket's logits (kernels/sampling.py), unmasked ...
    SAMPLE_MASKED = "sample_masked"  # ... and under a grammar's bitmask
    SAMPLE_VERIFY = "sample_verify"  # ... and of rows that verify drafts: their accepted runs stored, samples packed


# replayed at the decode graph's own bucket, never padded further
EXACT = (Kind.SAMPLE, Kind.SAMPLE_MASKED, Kind.SAMPLE_VERIFY)


def bucket_for(capture_sizes: list[int], size: int) -> int | None:
    """The smallest captured size ≥ size (sizes ascending); None when it is larger than every one (eager)."""
    i = bisect.bisect_left(capture_sizes, size)
    return capture_sizes[i] if i < len(capture_sizes) else None


class GraphTable:
    """Every captured graph of a runner, by kind; route() is the one decision of which graph runs a step."""

    def __init__(self):
        self.runners: dict[Kind, GraphRunner] = {}

    def add(self, kind: Kind, runner: GraphRunner) -> None:
        self.runners[kind] = runner

    def sizes(self, kind: Kind) -> list[int]:
        gr = self.runners.get(kind)
        return list(gr.capture_sizes) if gr is not None else []

    def route(self, kind: Kind, size: int, fits: bool = True) -> int | None:
        """The captured size that runs a step of `kind` and `size` rows / tokens (a SAMPLE kind: the decode bucket),
        or None when it runs eagerly. fits: the step's inputs fit the static buffers."""
        gr = self.runners.get(kind)
        if gr is None or not fits:
            return None
        if kind in EXACT:
            return size if size in gr.graphs else None
        return bucket_for(gr.capture_sizes, size)

    def replay(self, kind: Kind, size: int) -> torch.Tensor:
        """Replay a routed graph (its inputs loaded); its static output."""
        return self.runners[kind].replay(size)

    def entries(self) -> Iterator[tuple[Kind, int]]:
        """Every (kind, size) captured, for the start-up self-check."""
        for kind, gr in self.runners.items():
            for size in gr.capture_sizes:
                yield kind, size

    @property
    def pool(self):
        """The one graph memory pool every kind shares (None before the first capture)."""
        return next((gr.pool for gr in self.runners.values() if gr.pool is not None), None)

    @property
    def pool_bytes(self) -> int:
        return sum(gr.pool_bytes for gr in self.runners.values())

    @property
    def capture_seconds(self) -> float:
        return sum(gr.capture_seconds for gr in self.runners.values())


__all__ = ["Kind", "GraphTable", "bucket_for"]
