"""Structured outputs in the engine core: xgrammar grammars compiled off the loop, one matcher per sequence, and
each step's token bitmask.

A constrained request's grammar is compiled on a thread pool by one xgrammar GrammarCompiler for the engine's
tokenizer (its vocabulary as wide as the model's logits, the core's EOS ids as stop tokens). Compiled grammars are
cached by the constraint's normalised key, so the n > 1 children of a request and repeated schemas compile once; the
cache is bounded by the compiled grammars' bytes (GRAMMAR_CACHE_BYTES), and a grammar that alone takes more than
GRAMMAR_MAX_BYTES fails its request with an error saying so. The
sequence waits outside the scheduler until its grammar is ready; the others keep running meanwhile. Each sequence
then has its own GrammarMatcher; every token the host learns is accepted by it, and a matcher that terminates (the
grammar is complete and a stop token was accepted) finishes its sequence with "stop".

How the mask of step N+1 is ready in time: a row's mask depends on its token of step N, which the host learns one
step late (the loop runs ahead: step N+1 is launched before step N is read). A step with grammar rows launches its
forward; its sampler waits (EngineCore.step). The next call of the loop reads step N (its tokens arrive as forward N+1
starts), advances the matchers, and starts filling step N+1's bitmask (pinned; the rows without a grammar allow
every token). From GRAMMAR_FILL_THREAD_MIN_ROWS rows the fill runs on the mask thread, inside xgrammar (its own
threads, the GIL released), while the core schedules and builds step N+2; then the core launches N+1's sampler (the
mask applied inside its one kernel, kernels/sampling.py, or with the float32 copy of the general path) and
forward N+2, which reads its tokens. The mask travels with the batch (SamplingBatch.grammar_rows / grammar_bitmask;
to every tensor-parallel rank too) and is copied to the device without a sync. The device idles only if reading,
matching and the fill outlast a forward. Unconstrained batches carry no mask and take the sampler's paths unchanged.
The bitmask buffer is refilled only after the step that copied it was read. benchmarks/structured_overhead.py
measures the cost.

Validation: `check()` builds the constraint's grammar without a tokenizer (fast), so front ends refuse a bad
schema, regex or grammar with a ValueError naming the problem before anything reaches the core.
"""
from __future__ import annotations

import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from nanoserve.config import (GRAMMAR_CACHE_BYTES, GRAMMAR_CACHE_SIZE, GRAMMAR_COMPILE_THREADS,
                              GRAMMAR_FILL_THREAD_MIN_ROWS, GRAMMAR_MAX_BYTES, STRUCTURED_JSON_MAX_WHITESPACE)
from nanoserve.errors import RequestError
from nanoserve.sampling import StructuredOutputsParams

# compact JSON (json.dumps' ", " and ": "), unless the request allows whitespace: then bounded at each place
_JSON_OPTIONS = {False: {"any_whitespace": False},
                 True: {"any_whitespace": True, "max_whitespace_cnt": STRUCTURED_JSON_MAX_WHITESPACE}}
_ANY_OBJECT = '{"type": "object"}'  # json_object: OpenAI's JSON mode asks for an object
# xgrammar's errors start with a timestamp, a source location and sometimes the failed check: not the user's concern
_NOISE = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: .*? is false: )?")


def xgrammar():
    """The xgrammar module, imported on first use (only constrained requests need it)."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured outputs need xgrammar: pip install xgrammar") from None
    return xgr


def grammar_of(so: StructuredOutputsParams, where: str | None = None):
    """The constraint as an xgrammar Grammar (no tokenizer needed); a ValueError naming what is wrong, said of
    `where` (the field it came from; structured_outputs.<kind> by default)."""
    xgr = xgrammar()
    kind, text, whitespace = so.key
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, **_JSON_OPTIONS[whitespace])
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, **_JSON_OPTIONS[whitespace])
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":  # EBNF string literals take JSON's escapes
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice))
        # grammar: EBNF (GBNF-style `root ::= ...`), or Lark as vLLM also accepts
        return xgr.Grammar.from_ebnf(text) if "::=" in text else xgr.Grammar.from_lark(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise RequestError(f"{where or 'structured_outputs.' + kind}: {_reason(e)}", param="structured_outputs") \
            from None


def _reason(e: Exception) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _NOISE.sub("", lines[0]) if lines else type(e).__name__


def check(so: StructuredOutputsParams | None, where: str | None = None) -> None:
    """Raise RequestError (a ValueError) if the constraint cannot be compiled (an invalid schema, regex or grammar)."""
    if so is not None:
        grammar_of(so, where)


class Grammars:
    """The engine core's grammars: compiled on a thread pool, cached by key, one matcher per sequence, and the bitmask
    buffer each constrained step fills."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: list[int],
                 max_rows: int, pin_memory: bool):
        """load_tokenizer: called once, on the pool, by the first compilation (the tokenizer info takes a while)."""
        self._xgr = xgrammar()
        self._load_tokenizer, self._vocab_size = load_tokenizer, vocab_size
        self._stop_ids = frozenset(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(GRAMMAR_COMPILE_THREADS, thread_name_prefix="nanoserve-grammar")
        self._mask_jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._mask_thread, name="nanoserve-mask", daemon=True).start()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._sizes: dict[tuple, int] = {}  # compiled grammars' bytes, by key
        self.cached_bytes, self.cache_bytes, self.max_bytes = 0, GRAMMAR_CACHE_BYTES, GRAMMAR_MAX_BYTES
        bitmask = self._xgr.allocate_token_bitmask(max_rows, vocab_size)  # [rows, ceil(vocab / 32)] int32
        self._batch = self._xgr.BatchGrammarMatcher()
        self._bitmask = bitmask.pin_memory() if pin_memory else bitmask

    def compile(self, so: StructuredOutputsParams) -> Future:
        """The compiled grammar of this constraint, as a future (done at once when cached)."""
        key = so.key
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._compile, so)
            self._evict()
        return future

    def _compile(self, so: StructuredOutputsParams):
        """On the pool: the compiled grammar, refused (a ValueError the core answers as the request's error) when it
        alone takes more than max_bytes; its size counts against the cache's bytes."""
        compiled = self._the_compiler().compile_grammar(grammar_of(so))
        size = compiled.memory_size_bytes
        if size > self.max_bytes:
            raise ValueError(f"its compiled grammar takes {size / 2**20:.0f} MiB, more than this server allows for one "
                             f"({self.max_bytes / 2**20:.0f} MiB): constrain the output with a smaller schema (fewer "
                             "enum values or alternatives, shorter bounded repeats)")
        with self._cache_lock:
            if so.key in self._cache:
                self._sizes[so.key] = size
                self.cached_bytes += size
                self._evict()
        return compiled

    def _evict(self) -> None:
        """Drop the least recently used grammars beyond GRAMMAR_CACHE_SIZE entries or cache_bytes (under the lock)."""
        while len(self._cache) > GRAMMAR_CACHE_SIZE or (self.cached_bytes > self.cache_bytes and len(self._cache) > 1):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(key, 0)

    def _the_compiler(self):
        """Made by the first compilation (the others wait for it); compilations then run in parallel."""
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr
                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self._vocab_size,
                                                          stop_token_ids=sorted(self._stop_ids))
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached here, by key
            return self._compiler

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def ends(self, accepted_token: int) -> bool:
        """Whether a matcher that accepted this token has ended (is terminated): xgrammar's matchers end exactly when
        they accept a stop token, which they do only once their grammar is complete."""
        return accepted_token in self._stop_ids

    def accept(self, seqs: list, tokens: list[int]) -> list[bool] | None:
        """Advance the matchers of the rows that have one by their tokens; per row, whether its token fitted (rows
        without a matcher: True). None when no row has a matcher. (A loop of accept_token: xgrammar's batch call
        measured slower for 64 rows, its result converted in Python.)"""
        if not any(s.grammar is not None for s in seqs):
            return None
        return [s.grammar is None or s.grammar.accept_token(t) for s, t in zip(seqs, tokens)]

    def start_fill(self, matchers: list) -> "MaskFill | None":
        """Start filling the bitmask of a step's sampled rows, given each row's matcher or None: the rows with one by
        xgrammar (its threads), the others with every token allowed; None when no row has a matcher. From
        GRAMMAR_FILL_THREAD_MIN_ROWS rows the fill runs on the mask thread while the caller goes on: the caller waits
        only until that thread is inside xgrammar, which releases the GIL (else the thread would wait for the GIL
        until the caller blocks). The buffer is reused by the next constrained step, which fills it only after
        reading this one."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if len(rows) < len(matchers):  # so the kernel masks all rows and needs no row indices (a pageable copy)
            self._bitmask[[i for i, m in enumerate(matchers) if m is None]] = -1
        fill = MaskFill(np.array(rows, np.int32), self._bitmask[:len(matchers)])
        matchers = [matchers[i] for i in rows]
        if len(rows) < GRAMMAR_FILL_THREAD_MIN_ROWS:
            self._fill(matchers, rows)
            return fill
        fill.done = threading.Event()
        inside = threading.Event()
        self._mask_jobs.put((fill, matchers, rows, inside))
        inside.wait()
        return fill

    def _fill(self, matchers: list, rows: list[int]) -> None:
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(self._bitmask, rows[0])
        else:  # xgrammar's threads fill the rows in parallel
            self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices=rows)

    def _mask_thread(self) -> None:
        """Fills masks handed over by start_fill, until close() sends None."""
        while (job := self._mask_jobs.get()) is not None:
            fill, matchers, rows, inside = job
            inside.set()
            try:
                self._fill(matchers, rows)
            except BaseException as e:  # (raised to the core by MaskFill.result)
                fill.error = e
            fill.done.set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_jobs.put(None)


class MaskFill:
    """A step's bitmask, being filled (by Grammars.start_fill)."""

    done: threading.Event | None = None  # set by the mask thread; None when filled on the caller's thread
    error: BaseException | None = None

    def __init__(self, rows: np.ndarray, bitmask: torch.Tensor):
        self.rows, self.bitmask = rows, bitmask

    def result(self) -> tuple[np.ndarray, torch.Tensor]:
        """The rows that have a matcher, and the bitmask of every row, once filled."""
        if self.done is not None:
            self.done.wait()
        if self.error is not None:
            raise self.error
        return self.rows, self.bitmask


__all__ = ["Grammars", "MaskFill", "check", "grammar_of", "xgrammar"]
