"""The CUDA-graph size settings (cudagraph_capture_sizes, prefill_graph_sizes): what a user may give (a mode word or
sizes), checked once in EngineConfig, and the GraphSizes a resolved config holds."""
from __future__ import annotations

from dataclasses import dataclass

CAPTURE_SIZE_MODES = ("auto", "pow2")
PREFILL_GRAPH_MODES = ("auto", "off")


@dataclass(frozen=True)
class GraphSizes:
    """A resolved graph-size setting (cudagraph_capture_sizes, prefill_graph_sizes): `sizes` to capture as given,
    or, when `planned` ("auto"), sizes the runner plans at start-up from measured replays, none over `largest`.
    `largest` is the largest graph either way; GraphSizes() (false) means no graphs."""

    sizes: tuple[int, ...] = ()
    planned: bool = False
    largest: int = 0

    def __bool__(self) -> bool:
        return self.largest > 0

    @classmethod
    def given(cls, sizes) -> "GraphSizes":
        return cls(tuple(sizes), False, max(sizes, default=0))


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """The design notes' buckets: powers of two below max_num_seqs, plus max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def capture_sizes(value, max_num_seqs: int) -> list[int] | str | GraphSizes:
    if isinstance(value, GraphSizes):  # resolved already
        return value
    sizes = _size_list("cudagraph_capture_sizes", value, CAPTURE_SIZE_MODES)
    if isinstance(sizes, list) and sizes and max(sizes) > max_num_seqs:
        raise ValueError(f"cudagraph_capture_sizes {sizes} exceed max_num_seqs={max_num_seqs}")
    return sizes


def prefill_graph_sizes(value) -> list[int] | str | GraphSizes:
    if isinstance(value, GraphSizes):
        return value
    return _size_list("prefill_graph_sizes", value, PREFILL_GRAPH_MODES)


def _size_list(name: str, value, modes: tuple[str, ...]) -> list[int] | str:
    """One of `modes` (also given as a one-word list, as the CLI passes it) or ascending distinct positive sizes."""
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], str) and not value[0].isdigit():
        value = value[0]
    if isinstance(value, str):
        if value not in modes:
            raise ValueError(f"{name} must be one of {modes} or a list of sizes, got {value!r}")
        return value
    sizes = [int(s) if isinstance(s, str) and s.isdigit() else s for s in value]
    if any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes):
        raise ValueError(f"{name} must be positive integers, got {list(value)}")
    return sorted(set(sizes))


__all__ = ["CAPTURE_SIZE_MODES", "PREFILL_GRAPH_MODES", "GraphSizes", "capture_sizes", "default_capture_sizes",
           "prefill_graph_sizes"]
