"""The device n-gram proposer (kernels/ngram.py): the Triton kernel (CPU: the interpreter) == its PyTorch reference ==
the host NgramProposer (engine/drafts.py) fed the same tokens, over the edge cases of the rule."""
from __future__ import annotations

import pytest
import torch

from nanoserve.engine.drafts import NgramProposer
from nanoserve.kernels import ngram
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.ngram import propose_ngram, propose_ngram_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton on CPU tensors needs the interpreter
SMALL_BLOCK = 16  # tiles of the CPU cases: several per history, so the scan crosses tile edges
PAD = 7  # the token past every length: it must never be read as history (it is also in the histories' vocabulary)


def host_drafts(histories: list[list[int]], rows: list[int], k: int, lo: int, hi: int) -> list[list[int]]:
    """NgramProposer's drafts for each row's slot, its tokens given as a prompt and then extended in two pieces."""
    proposer, out = NgramProposer(lo, hi), []
    for slot, tokens in enumerate(histories):
        cut = len(tokens) // 2
        proposer.add(str(slot), tokens[:cut])
        proposer.extend(str(slot), tokens[cut:cut + 1])
        proposer.extend(str(slot), tokens[cut + 1:])
    return [proposer.propose(str(slot), k) for slot in rows]


def check(histories: list[list[int]], rows: list[int], k: int, lo: int, hi: int, width: int | None = None) -> None:
    """Kernel == reference == NgramProposer on these histories (slot i's tokens) for these rows."""
    width = width or max(1, max(map(len, histories)))
    history = torch.full((len(histories), width), PAD, dtype=torch.int32)
    for slot, tokens in enumerate(histories):
        history[slot, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    lengths = torch.tensor(list(map(len, histories)), dtype=torch.int32)
    args = [t.to(DEVICE) for t in (history, lengths, torch.tensor(rows, dtype=torch.int32))]
    want = host_drafts(histories, rows, k, lo, hi)
    ref = propose_ngram_ref(*args, k, lo, hi)
    got = propose_ngram(*args, k, lo, hi)
    for name, (drafts, counts) in (("reference", ref), ("kernel", got)):
        assert drafts.shape == (len(rows), k) and counts.shape == (len(rows),), name
        listed = [d[:c] for d, c in zip(drafts.tolist(), counts.tolist())]
        assert listed == want, name
        assert all(d[c:] == [-1] * (k - c) for d, c in zip(drafts.tolist(), counts.tolist())), name


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(ngram, "BLOCK", SMALL_BLOCK)


pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
small_cases = pytest.mark.usefixtures("force_triton", "small_tiles")  # the kernel at small sizes, on any device


@small_cases
@pytest.mark.parametrize("vocab", [2, 3, 8])
@pytest.mark.parametrize("k, lo, hi", [(4, 1, 3), (3, 2, 5), (5, 3, 3), (2, 1, 1)])
def test_random_histories_of_small_vocabularies(vocab, k, lo, hi):
    """Matches everywhere, of every n; lengths 0..70 on one buffer, every slot drafted for."""
    g = torch.Generator().manual_seed(vocab * 100 + k * 10 + lo)
    lengths = [0, 1, 2, 3, 5, 16, 17, 33, 70] + torch.randint(0, 70, (5,), generator=g).tolist()
    histories = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    check(histories, list(range(len(histories))), k, lo, hi, width=72)


@small_cases
def test_copied_spans_and_rows_in_any_order():
    """A long random text whose tail repeats an earlier span (the copying prompt lookup serves), rows permuted, one
    slot twice, one slot not drafted for."""
    g = torch.Generator().manual_seed(3)
    texts = []
    for size, at, span in [(60, 10, 6), (80, 50, 4), (45, 0, 3), (64, 30, 20)]:
        text = torch.randint(100, 100_000, (size,), generator=g).tolist()
        texts.append(text + text[at:at + span])  # the suffix repeats text[at:at + span]; the draft is what followed
    texts.append(list(range(100, 160)))  # no repeats: no drafts
    rows = [3, 0, 4, 2, 0]
    check(texts, rows, 5, 1, 4)
    check(texts, rows, 5, 3, 4)  # the 3-token copy alone still matches; shorter ones do not at lookup_min 3


@small_cases
@pytest.mark.parametrize("k", [1, 4, 9])
def test_edge_sizes(k):
    """size 0 and 1 (nothing to look up), size < lookup_min, a match at the very start (start = n), a match whose
    continuation is shorter than k (drafts stop at the last known token), a longer n that wins over a later short
    match, and the suffix that must not match itself."""
    histories = [[], [5], [5, 5], [9, 4, 4, 4],
                 [1, 2, 3, 4, 5, 6, 1, 2],  # "1 2" at the start: drafts 3 4 5 6 1 2 ...
                 [3, 1, 2, 8, 8, 8, 2, 6, 1, 2],  # "1 2" (n=2) at start 3 beats the later "2" (n=1) at start 7
                 [7, 7, 7, 7, 7],  # every start matches: the latest, start 4, one draft
                 [4, 6, 4]]  # "4" at start 1: drafts 6 4
    rows = list(range(len(histories)))
    check(histories, rows, k, 1, 3)
    check(histories, rows, k, 3, 4)


@small_cases
def test_no_rows():
    drafts, counts = propose_ngram(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE),
                                   torch.full((2,), 8, dtype=torch.int32, device=DEVICE),
                                   torch.zeros(0, dtype=torch.int32, device=DEVICE), 3, 1, 2)
    assert drafts.shape == (0, 3) and counts.shape == (0,)


@small_cases
def test_out_buffers_are_written_in_place():
    history = torch.tensor([[1, 2, 9, 1, 2], [3, 3, 3, 3, 3]], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([5, 2], dtype=torch.int32, device=DEVICE)
    out = (torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE))
    got = propose_ngram(history, lengths, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), 3, 1, 2, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert out[0].tolist() == [[9, 1, 2], [3, -1, -1]] and out[1].tolist() == [3, 1]


@small_cases
@pytest.mark.parametrize("bad, message", [
    (dict(k=0), "k >= 1"), (dict(lookup_min=0), "lookup_min"), (dict(lookup_min=3, lookup_max=2), "lookup_min"),
    (dict(history=torch.zeros(2, 4, dtype=torch.int64)), "history"), (dict(rows=torch.zeros(1)), "rows"),
    (dict(out=(torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))), "out")])
def test_unsupported_input_is_refused(bad, message):
    args = dict(history=torch.zeros(2, 4, dtype=torch.int32), lengths=torch.zeros(2, dtype=torch.int32),
                rows=torch.zeros(1, dtype=torch.int32), k=3, lookup_min=1, lookup_max=2) | bad
    with pytest.raises(ValueError, match=message):
        propose_ngram(**args)


@pytest.mark.gpu
def test_real_sizes_against_the_reference():
    """S = 256 slots of L = 8192, R = 256 rows (a permutation): random text (no match, a full scan), copied spans
    (a long match far back), small vocabularies (early stops), lengths from 0 to L."""
    slots, width, k, g = 256, 8192, 5, torch.Generator().manual_seed(0)
    history = torch.randint(0, 150_000, (slots, width), generator=g, dtype=torch.int32)
    history[::4] %= 4  # a quarter of small vocabulary
    lengths = torch.randint(0, width + 1, (slots,), generator=g, dtype=torch.int32)
    lengths[:3] = torch.tensor([0, 1, width], dtype=torch.int32)
    for slot in range(1, slots, 4):  # a copy of an early span at the end
        n = int(lengths[slot])
        if n > 200:
            history[slot, n - 6:n] = history[slot, 40:46]
    rows = torch.randperm(slots, generator=g).to(torch.int32)
    for lo, hi in [(1, 3), (2, 5)]:
        want = propose_ngram_ref(history, lengths, rows, k, lo, hi)
        got = propose_ngram(*(t.cuda() for t in (history, lengths, rows)), k, lo, hi)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.gpu
def test_a_captured_graph_drafts_from_the_buffers_as_they_are_at_replay():
    """The launch is CUDA-graph capturable: replays read the history and lengths written after capture."""
    slots, width, k = 8, 4096, 4
    history = torch.randint(0, 6, (slots, width), dtype=torch.int32, device="cuda")
    lengths = torch.full((slots,), 100, dtype=torch.int32, device="cuda")
    rows = torch.arange(slots - 1, -1, -1, dtype=torch.int32, device="cuda")
    out = (torch.empty(slots, k, dtype=torch.int32, device="cuda"),
           torch.empty(slots, dtype=torch.int32, device="cuda"))
    propose_ngram(history, lengths, rows, k, 1, 3, out=out)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        propose_ngram(history, lengths, rows, k, 1, 3, out=out)
    for step in range(3):
        history.random_(0, 6 + step * 1000)
        lengths.copy_(torch.randint(0, width + 1, (slots,), dtype=torch.int32))
        graph.replay()
        want = propose_ngram_ref(history.cpu(), lengths.cpu(), rows.cpu(), k, 1, 3)
        assert torch.equal(out[0].cpu(), want[0]) and torch.equal(out[1].cpu(), want[1])
