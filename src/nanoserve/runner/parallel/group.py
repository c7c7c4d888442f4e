"""RunnerGroup: ModelRunner's API over tensor_parallel_size ranks, so the engine core's loop is unchanged.

Rank 0 is a ModelRunner in this (the engine-core) process; ranks 1..N-1 are worker processes
(runner/parallel/worker.py, torch.multiprocessing spawn) joined to it by the engine's own torch.distributed group.
Each call that runs the model (execute, sample_deferred) is pickled once here
and queued for a sender thread that writes it to every worker's pipe, then made on rank 0: one message per step
(two when a structured-output step defers its sampler), and rank 0 never waits for a worker to read it, so async
scheduling keeps its overlap. Only rank 0's
SampleHandles are read; what the core reads of a runner (`info`, `counters`: runner/info.py) is rank 0's, which runs
every step the others do. Nothing else of rank 0's runner is reachable through the group: a call on rank 0 alone
would leave the ranks' collectives unmatched (on_every_rank() runs a function on every rank).

A dead worker becomes a WorkerError in the core, never a hang. A thread watches the workers' process
sentinels. On CPU, gloo fails the collective rank 0 is in at once (the peer's connection closes); on CUDA
the watcher aborts the NCCL communicator, so kernels waiting on the dead rank return. Either way the call
in progress, or the next one, raises naming the rank and its last error.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch.multiprocessing as torch_mp

from nanoserve.config import EngineConfig
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.runner.sampler import SampleHandle
from nanoserve.runner.parallel.distributed import TIMEOUT, connect, disconnect, rank_device
from nanoserve.runner.parallel.worker import portable, portable_sampling, recv, run_worker

logger = logging.getLogger("nanoserve")

REPLY_TIMEOUT_S = TIMEOUT.total_seconds()  # a worker's start-up message or call result
DEATH_GRACE_S = 5.0  # after a collective fails on rank 0: how long a dying worker may take to exit
ABORT_GRACE_S = 30.0  # after an NCCL abort: how long rank 0 may stay blocked on the device before exiting
CLOSE_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died: the engine cannot go on (close it, start a new one)."""


def create_runner(config: EngineConfig, hf_config):
    """The engine core's runner: a ModelRunner, or a RunnerGroup when tensor_parallel_size > 1."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, hf_config)
    return RunnerGroup(config, hf_config)


@dataclasses.dataclass
class _Worker:
    rank: int
    process: object  # a torch.multiprocessing Process
    conn: object  # the engine end of its duplex pipe


class RunnerGroup:
    """tensor_parallel_size ranks behind ModelRunner's API: rank 0 here, the others in worker processes."""

    def __init__(self, config: EngineConfig, hf_config):
        """config and hf_config passed engine/preflight.py's checks (sizes the ranks can share, a world here)."""
        size = config.tensor_parallel_size
        if torch_mp.current_process().daemon:
            raise ValueError(f"tensor_parallel_size={size} starts worker processes, which a daemonic process "
                             "cannot: start the engine core in a non-daemonic process")
        self.config, self.runner, self.tp, self.info = config, None, None, None
        self._dead: _Worker | None = None  # the first worker seen dead
        self._failure: str | None = None  # its error, once known: every later call raises it
        self._closing, self._busy, self._sender = False, 0, None
        # what closing releases, apart from the group object: a group dropped without close() (garbage
        # collection, interpreter exit) is released by this finalizer in order, as close() would
        self._parts = _Parts(tempfile.mkdtemp(prefix="nanoserve-tp-"))
        self._finalizer = weakref.finalize(self, self._parts.release, False)
        store = os.path.join(self._parts.dir, "store")
        try:
            for rank in range(1, size):
                self._parts.workers.append(self._spawn(rank, hf_config, store))
            self._sender = self._parts.sender = _Sender([w.conn for w in self._workers])
            self._start(hf_config, store)
        except BaseException:
            self._shutdown(abort=True)  # workers may wait in a collective for a rank 0 that is not coming
            raise

    @property
    def _workers(self) -> list[_Worker]:
        return self._parts.workers

    def _spawn(self, rank: int, hf_config, store: str) -> _Worker:
        ctx = torch_mp.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        config = dataclasses.replace(self.config, device=rank_device(self.config, rank), show_progress=False)
        process = ctx.Process(target=run_worker, name=f"nanoserve-tp-rank{rank}", daemon=True,
                              args=(theirs, rank, config, hf_config, store, logger.getEffectiveLevel()))
        process.start()
        theirs.close()  # so a dead worker's pipe reads as closed here
        return _Worker(rank, process, ours)

    def _start(self, hf_config, store: str) -> None:
        for w in self._workers:
            try:
                self._expect(w, "joining")
            except WorkerError as e:  # most often a script without a main guard, re-run by the spawned worker
                raise WorkerError(f"{e}, before joining the group (spawned workers import the script that started "
                                  "the engine: start it under `if __name__ == \"__main__\":`)") from None
        self.tp = self._parts.tp = connect(store, 0, self.config.tensor_parallel_size, self.config.torch_device)
        # the thread holds the group weakly: a dropped group is still collected (and its finalizer runs)
        threading.Thread(target=_watch, args=(weakref.ref(self), [w.process.sentinel for w in self._workers]),
                         name="nanoserve-tp-watch", daemon=True).start()
        self.runner = self._parts.runner = self._guarded(ModelRunner, self.config, hf_config, self.tp)
        self.info = self.runner.info
        for w in self._workers:
            blocks = self._expect(w, "ready")[1]
            if blocks != self.info.num_kv_blocks:  # the memory plan agrees on the smallest count
                raise RuntimeError(f"rank {w.rank} planned {blocks} KV blocks, rank 0 {self.info.num_kv_blocks}")

    # -- ModelRunner's API ------------------------------------------------------------------------
    @property
    def counters(self):
        return self.runner.counters

    def execute(self, batch, defer_sampling: bool = False):
        """Every rank runs the step; rank 0's SampleHandle (None when nothing is sampled, its PendingSample when the
        sampler is deferred) comes back."""
        self._broadcast(("execute", *portable(batch), defer_sampling))
        out = self._guarded(self.runner.execute, batch, defer_sampling)
        return _CheckedHandle(out, self) if isinstance(out, SampleHandle) else out

    def sample_deferred(self, pending, sampling):
        """Every rank launches the sampler of the step it deferred (each keeps its own PendingSample), with this
        sampling batch (seeds, grammar bitmask)."""
        self._broadcast(("sample", *portable_sampling(sampling)))
        return _CheckedHandle(self._guarded(self.runner.sample_deferred, pending, sampling), self)

    def save_batch_histogram(self) -> None:
        self.runner.save_batch_histogram()  # rank 0 saw every batch the others did

    def on_every_rank(self, fn, *args) -> list:
        """[fn(runner, *args) for every rank's runner], rank order; fn must pickle (a module-level function)."""
        self._broadcast(("call", fn, args, True))
        results = [self._guarded(fn, self.runner, *args)]
        return results + [self._expect(w, "result")[1] for w in self._workers]

    def _broadcast(self, message) -> None:
        self._check()
        self._sender.send(message)

    # -- failures ---------------------------------------------------------------------------------
    def _guarded(self, fn, *args):
        """fn(*args) on rank 0; a collective failing because a worker died raises WorkerError instead."""
        self._check()
        self._busy += 1
        try:
            out = fn(*args)
        except Exception as e:
            if isinstance(e, RuntimeError) and not isinstance(e, WorkerError):
                self._await_death(DEATH_GRACE_S)  # gloo fails the collective before the peer has exited
            if self._dead is not None:
                raise WorkerError(self._failure_text()) from e
            raise
        finally:
            self._busy -= 1
        self._check()  # on CUDA an aborted collective returns: what it computed is void
        return out

    def _check(self) -> None:
        if self._dead is not None or self._failure is not None:
            raise WorkerError(self._failure_text())

    def _failure_text(self) -> str:
        if self._failure is None:
            self._failure = self._describe(self._dead, None)
        return self._failure

    def _describe(self, w: _Worker, message) -> str:
        """One line for a failed worker: its exception's last line (the traceback is logged) or its exit code."""
        while message is None or message[0] != "error":
            try:
                if not w.conn.poll():
                    break
                message = recv(w.conn)
            except (EOFError, OSError):
                break
        if message is not None and message[0] == "error":
            logger.error("tensor-parallel worker rank %d failed:\n%s", w.rank, message[1])
            last = message[1].strip().splitlines()[-1] if message[1].strip() else "an error"
            return f"tensor-parallel worker rank {w.rank} failed: {last}"
        w.process.join(DEATH_GRACE_S)  # reap it: the exit code
        code = w.process.exitcode
        if code is None:
            return f"tensor-parallel worker rank {w.rank} stopped answering"
        return f"tensor-parallel worker rank {w.rank} died (exit code {code})"

    def _expect(self, w: _Worker, kind: str):
        """The worker's next message, which must be `kind`; WorkerError if it fails, dies or stays silent."""
        if not wait([w.conn, w.process.sentinel], REPLY_TIMEOUT_S):
            self._failure = f"tensor-parallel worker rank {w.rank} sent no {kind!r} within {REPLY_TIMEOUT_S:.0f} s"
            raise WorkerError(self._failure)
        message = None
        try:
            if w.conn.poll():
                message = recv(w.conn)
        except (EOFError, OSError):
            pass
        if message is not None and message[0] == kind:
            return message
        self._dead = self._dead or w
        self._failure = self._failure or self._describe(w, message)
        raise WorkerError(self._failure)

    def _await_death(self, seconds: float) -> None:
        """Mark the first worker that exits within `seconds` dead (its sentinel fires before it can be reaped)."""
        ready = wait([w.process.sentinel for w in self._workers], seconds)
        if self._dead is None:
            self._dead = next((w for w in self._workers if w.process.sentinel in ready), None)

    def _on_worker_exit(self, ready: list) -> None:
        """The watcher saw a worker exit: mark the group dead; on CUDA abort the communicator so rank 0 is not
        left waiting on the device, and if it stays blocked anyway exit the process."""
        if self._closing:
            return
        self._dead = self._dead or next(w for w in self._workers if w.process.sentinel in ready)
        if self.tp is None or self.tp.device.type != "cuda":
            return  # gloo raises in rank 0's collective by itself
        disconnect(self.tp, abort=True)
        deadline = time.monotonic() + ABORT_GRACE_S
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._busy and not self._closing:
            logger.critical("tensor-parallel worker rank %d died and rank 0 is still blocked on the device %.0f s "
                            "after the abort; exiting", self._dead.rank, ABORT_GRACE_S)
            os._exit(1)

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (killed if they do not exit), release the group and rank 0's cache and graphs."""
        self._shutdown(abort=self._dead is not None or self._failure is not None)

    def _shutdown(self, abort: bool) -> None:
        """abort: first cancel the group's collectives, so a worker blocked in one fails instead of waiting."""
        self._closing = True
        self._finalizer.detach()
        self._parts.release(abort)


def _watch(group_ref: weakref.ref, sentinels: list) -> None:
    """The watcher thread: waits for the first worker to exit; the group may be gone by then (dropped)."""
    ready = wait(sentinels)
    group = group_ref()
    if group is not None:
        group._on_worker_exit(ready)


@dataclasses.dataclass
class _Parts:
    """What a RunnerGroup releases, in order: rank 0's runner, the workers (told to close, killed if they do
    not exit), the process group, the rendezvous folder. Once; safe on a half-started group."""

    dir: str
    workers: list[_Worker] = dataclasses.field(default_factory=list)
    sender: _Sender | None = None
    tp: object = None  # rank 0's TensorParallel
    runner: ModelRunner | None = None
    released: bool = False

    def release(self, abort: bool) -> None:
        if self.released:
            return
        self.released = True
        if self.runner is not None:
            self.runner.close()
        if abort and self.tp is not None:
            disconnect(self.tp, abort=True)
        if self.sender is not None:
            self.sender.send(("close",))
            self.sender.close(CLOSE_TIMEOUT_S)
        for w in self.workers:
            w.process.join(CLOSE_TIMEOUT_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        if self.tp is not None:
            disconnect(self.tp)
        shutil.rmtree(self.dir, ignore_errors=True)


class _CheckedHandle:
    """Rank 0's SampleHandle; reading it raises WorkerError if a worker died meanwhile."""

    def __init__(self, handle, group: RunnerGroup):
        self._handle, self._group = handle, group

    def ready(self) -> bool:
        return self._handle.ready()

    def result(self):
        return self._group._guarded(self._handle.result)


class _Sender:
    """Writes each message to every worker's pipe on a thread of its own, in order: the engine thread only
    pickles (so the message is a snapshot of the batch) and never waits for a worker to read."""

    def __init__(self, conns: list):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(conns,), name="nanoserve-tp-send", daemon=True)
        self._thread.start()

    def send(self, message) -> None:
        self._queue.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self, conns: list) -> None:
        live = list(conns)
        while (data := self._queue.get()) is not None:
            for conn in list(live):
                try:
                    conn.send_bytes(data)
                except OSError:  # a dead worker: the watcher reports it
                    live.remove(conn)
