"""Structured outputs in the engine core: xgrammar grammars compiled off the loop, one matcher per sequence, and
each step's token bitmask.

A constrained request's grammar is compiled on a thread pool (GRAMMAR_COMPILE_THREADS) by one xgrammar
GrammarCompiler for the engine's tokenizer (its vocabulary as wide as the model's logits, the core's EOS ids as stop
tokens). Compiled grammars are cached by the constraint's normalised key, so the n > 1 children of a request and
repeated schemas compile once, and a request of a constraint being compiled waits on that compile. The sequence waits
outside the scheduler until its grammar is ready; the others keep running meanwhile. Each sequence then has its own
GrammarMatcher; every token the host learns is accepted by it, and a matcher that terminates (the grammar is complete
and a stop token was accepted) finishes its sequence with "stop".

Limits, and what a client sees (config.py; NANOSERVE_GRAMMAR_MAX_BYTES and NANOSERVE_GRAMMAR_COMPILE_SECONDS set
the last two):
- the cache holds at most GRAMMAR_CACHE_BYTES (512 MiB) of compiled grammars, least recently used dropped first;
- a constraint whose compiled grammar alone takes more than GRAMMAR_MAX_BYTES (64 MiB; a 50k-value enum takes ~180 MB)
  fails its request with an error naming both sizes;
- a constraint not compiled GRAMMAR_COMPILE_SECONDS (10 s) after it reached the core (waiting for a thread included)
  fails its request(s) with an error naming the limit. expire() checks the deadlines; the core calls it where it
  polls its waiting sequences (each step; every 10 ms when only grammars are compiling), so their requests end on
  time and every other request keeps being scheduled. A thread cannot be stopped: the compile keeps its pool thread
  until xgrammar returns. Meanwhile the same constraint sent again is refused at once, on that compile's future
  (no second compile starts: copies of one slow constraint cannot fill the pool); once it ends, its result is
  cached as any other (refused if over GRAMMAR_MAX_BYTES), so that a repeat does not tie up a thread again. A
  compile that had not started by then (both threads busy) is cancelled, its requests told to retry later.
Through the server each of these is a 400 with code "engine_rejected" ("cannot compile the grammar: ..."), or, for
a streamed request, an error event before [DONE]. Refusals are cached like grammars (a repeat is refused at once).

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

Beside speculative decoding a constrained sequence verifies drafts the host knows (engine/core.py: while one runs,
drafts come from the host's proposer and each step waits for the one before, unless the plan finds waiting not worth
it; a draft model's, which only the device knows, are then not offered). trim_drafts keeps the drafts its grammar
accepts; the verification's rows are each masked as the matcher stands after the drafts before them (accepted, filled,
rolled back: _fill_drafted), so every verified position obeys the grammar; reading the step advances the matcher by
the run the verification kept (accept_run).

Validation: `check()` builds the constraint's grammar without a tokenizer (fast), so front ends refuse a bad
schema, regex or grammar with a ValueError naming the problem before anything reaches the core.
"""
from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from nanoserve.config import (GRAMMAR_CACHE_BYTES, GRAMMAR_CACHE_SIZE, GRAMMAR_COMPILE_SECONDS,
                              GRAMMAR_COMPILE_THREADS, GRAMMAR_FILL_THREAD_MIN_ROWS, GRAMMAR_MAX_BYTES,
                              STRUCTURED_JSON_MAX_WHITESPACE)
from nanoserve.errors import RequestError
from nanoserve.sampling import StructuredOutputsParams

# compact JSON (json.dumps' ", " and ": "), unless the request allows whitespace: then bounded at each place
_JSON_OPTIONS = {False: {"any_whitespace": False},
                 True: {"any_whitespace": True, "max_whitespace_cnt": STRUCTURED_JSON_MAX_WHITESPACE}}
_ANY_OBJECT = '{"type": "object"}'  # json_object: OpenAI's JSON mode asks for an object
# xgrammar's errors start with a timestamp, a source location and sometimes the failed check: not the user's concern
_NOISE = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: .*? is false: )?")
_SIMPLER = "constrain the output with a simpler schema (fewer enum values or alternatives, shorter bounded repeats)"
logger = logging.getLogger("nanoserve")


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
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # compiles ended: grammars or refusals, by key
        self._compiling: dict[tuple, _Compile] = {}  # compiles asked for, not ended (past their deadline too)
        self._cache_lock = threading.Lock()  # (both maps)
        self._sizes: dict[tuple, int] = {}  # compiled grammars' bytes, by key
        self.cached_bytes, self.cache_bytes, self.max_bytes = 0, GRAMMAR_CACHE_BYTES, GRAMMAR_MAX_BYTES
        self.compile_seconds = GRAMMAR_COMPILE_SECONDS
        bitmask = self._xgr.allocate_token_bitmask(max_rows, vocab_size)  # [rows, ceil(vocab / 32)] int32
        self._batch = self._xgr.BatchGrammarMatcher()
        self._bitmask = bitmask.pin_memory() if pin_memory else bitmask

    def compile(self, so: StructuredOutputsParams) -> Future:
        """The compiled grammar of this constraint, as a future: done at once when cached (a refusal too), else that
        of its compile under way, which the same constraint sent again shares (one past its deadline is refused at
        once: no second compile of a slow constraint starts while the first runs)."""
        key = so.key
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            job = self._compiling.get(key)
            if job is None:
                job = self._compiling[key] = _Compile(time.monotonic() + self.compile_seconds)
                job.pool_future = self._pool.submit(self._run, so, job)
            return job.future

    def expire(self) -> None:
        """Refuse the compiles past their deadline (compile_seconds after they were asked for, queueing included), so
        the sequences waiting on them end: the engine core calls this where it polls its waiting sequences. One that
        never started (every thread busy) is cancelled; one running keeps its thread until xgrammar returns (it
        cannot be stopped), and its constraint stays refused meanwhile."""
        now = time.monotonic()
        with self._cache_lock:
            for key, job in list(self._compiling.items()):
                if job.future.done() or now < job.deadline:
                    continue
                if job.pool_future.cancel():  # (not the constraint's fault: it is not remembered)
                    del self._compiling[key]
                    job.future.set_exception(ValueError(
                        f"no grammar compile thread came free within {self.compile_seconds:g} s (other constraints "
                        "were compiling): retry later"))
                    continue
                logger.warning("a grammar (%s) still compiling at its %g s deadline is refused; its thread runs on "
                               "until xgrammar returns", key[0], self.compile_seconds)
                job.future.set_exception(ValueError(
                    f"it did not compile within {self.compile_seconds:g} s, the most this server allows for one: "
                    f"{_SIMPLER}"))

    def _run(self, so: StructuredOutputsParams, job: "_Compile") -> None:
        """On the pool: compile, then hand the outcome (the grammar or its error) to the waiting sequences and the
        cache. A compile that ended past its deadline (its sequences were refused) is cached all the same: the work
        is done, the byte limits hold for it as for any, and a repeat of its constraint is then answered from the
        cache instead of holding a thread for as long again."""
        job.started = time.monotonic()
        outcome: Future = Future()
        size = 0
        try:
            compiled, size = self._compile(so)
            outcome.set_result(compiled)
        except Exception as e:
            outcome.set_exception(e)
        with self._cache_lock:
            self._compiling.pop(so.key, None)
            if job.future.done():  # refused by expire()
                logger.info("a grammar (%s) refused at its deadline finished compiling after %.1f s", so.key[0],
                            time.monotonic() - job.started)
            else:
                _copy_outcome(outcome, job.future)
            self._cache[so.key] = outcome
            self._sizes[so.key] = size
            self.cached_bytes += size
            self._evict()

    def _compile(self, so: StructuredOutputsParams) -> tuple[object, int]:
        """The compiled grammar and its bytes, refused (a ValueError the core answers as the request's error) when it
        alone takes more than max_bytes."""
        compiled = self._the_compiler().compile_grammar(grammar_of(so))
        size = compiled.memory_size_bytes
        if size > self.max_bytes:
            raise ValueError(f"its compiled grammar takes {_size(size)}, more than this server allows for one "
                             f"({_size(self.max_bytes)}): {_SIMPLER}")
        return compiled, size

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

    def trim_drafts(self, seqs: list) -> None:
        """Speculation beside structured outputs: a constrained sequence keeps the drafts its grammar accepts, in order,
        up to the first it refuses or a stop token (which would end it: a sample may still be one); its matcher is
        rolled back to where it stood. (Drafts the host does not know, DEVICE_DRAFT, are never offered to these.)"""
        for seq in seqs:
            matcher, drafts = seq.grammar, seq.draft_token_ids
            if matcher is None or not drafts:
                continue
            n = 0
            while n < len(drafts) and drafts[n] >= 0 and not self.ends(drafts[n]) and matcher.accept_token(drafts[n]):
                n += 1
            if n:
                matcher.rollback(n)
            seq.draft_token_ids = drafts[:n]

    def accept_run(self, matcher, tokens: list[int]) -> int:
        """Advance a matcher by the tokens a verification kept: how many it took before one it refused (all of them
        once a stop token ends it: the sequence ends there)."""
        for i, token in enumerate(tokens):
            if not matcher.accept_token(token):
                return i
            if self.ends(token):
                break
        return len(tokens)

    def start_fill(self, matchers: list, drafts: list[list[int]] | None = None) -> "MaskFill | None":
        """Start filling the bitmask of a step's sampled rows, given each row's matcher or None: the rows with one by
        xgrammar (its threads), the others with every token allowed; None when no row has a matcher. drafts: per
        entry, the drafts its rows verify (trim_drafts kept them): the entry then has a row per draft and one more,
        row j masked as its matcher stands after the first j drafts (_fill_drafted). From
        GRAMMAR_FILL_THREAD_MIN_ROWS rows the fill runs on the mask thread while the caller goes on: the caller waits
        only until that thread is inside xgrammar, which releases the GIL (else the thread would wait for the GIL
        until the caller blocks). The buffer is reused by the next constrained step, which fills it only after
        reading this one."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if drafts is not None and any(drafts):  # (rows past an entry's first are the next entries')
            return self._fill_drafted(matchers, drafts)
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

    def _fill_drafted(self, matchers: list, drafts: list[list[int]]) -> "MaskFill":
        """A verification's masks, on the caller's thread: each constrained entry's rows in turn, its matcher advanced
        by one draft between them and rolled back after; the other rows allow every token."""
        n = sum(1 + len(d) for d in drafts)
        self._bitmask[:n] = -1
        rows, first = [], 0
        for matcher, entry in zip(matchers, drafts):
            if matcher is not None:
                for j in range(len(entry) + 1):
                    matcher.fill_next_token_bitmask(self._bitmask, first + j)
                    if j < len(entry) and not matcher.accept_token(entry[j]):
                        raise RuntimeError(f"a draft its grammar accepted before ({entry[j]}) is refused")
                if entry:
                    matcher.rollback(len(entry))
                rows += range(first, first + len(entry) + 1)
            first += 1 + len(entry)
        return MaskFill(np.array(rows, np.int32), self._bitmask[:n])

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


class _Compile:
    """A compile asked for: the future its waiting sequences hold (ended by the compile, or refused by
    Grammars.expire at the deadline), the pool's own future (cancelled if it never started), when it started."""

    def __init__(self, deadline: float):
        self.deadline, self.future = deadline, Future()
        self.pool_future: Future | None = None
        self.started: float | None = None


def _copy_outcome(source: Future, target: Future) -> None:
    error = source.exception()
    if error is None:
        target.set_result(source.result())
    else:
        target.set_exception(error)


def _size(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


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
