"""A tensor-parallel worker: one process per rank after 0, running its own ModelRunner in lockstep with rank 0.

Rank 0's RunnerGroup (runner/parallel/group.py, in the engine-core process) sends every step's batch and every other
runner call down this process's pipe, in order, and the worker makes the same call on its runner: same
batch, same graph bucket, same sampling seeds, so the collectives inside each forward line up and every
rank samples the same tokens into its own per-slot state. Its SampleHandles are never read (rank 0's are).

Messages in: ("execute", batch, generator states, defer_sampling) | ("sample", sampling batch, generator states)
(the deferred sampler, with the step's complete sampling batch) | ("call", fn, args, reply) | ("close",).
Out: ("joining",) before the rendezvous, ("ready", num_kv_blocks) after start-up, ("result", value) for a call that wants one,
("error", traceback) before exiting on any failure. A failed call leaves the ranks out of step, so the worker
exits rather than carry on; it also exits when the engine process dies, so no worker outlives its engine.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import wait

import torch

from nanoserve.runner.batch import DecodeBatch, PrefillBatch, SamplingBatch
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.runner.parallel.distributed import connect, disconnect


def send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def portable(batch: DecodeBatch | PrefillBatch) -> tuple[DecodeBatch | PrefillBatch, list | None]:
    """The batch as it is pickled to the workers (portable_sampling), and its generators' states."""
    sb, states = portable_sampling(batch.sampling)
    return (batch if sb is batch.sampling else dataclasses.replace(batch, sampling=sb)), states


def portable_sampling(sb: SamplingBatch | None) -> tuple[SamplingBatch | None, list | None]:
    """The sampling batch without its torch.Generators, and their states: a seeded row's generator lives in the
    engine core, so each step ships the state it is about to sample from (taken before rank 0 samples). A grammar
    bitmask is a view of rank 0's buffer: its rows are copied, so the pickle holds them alone."""
    if sb is None or (sb.generators is None and sb.grammar_bitmask is None):
        return sb, None
    states = None if sb.generators is None else [None if g is None else g.get_state() for g in sb.generators]
    bitmask = None if sb.grammar_bitmask is None else sb.grammar_bitmask.clone()
    return dataclasses.replace(sb, generators=None, grammar_bitmask=bitmask), states


def restore(batch: DecodeBatch | PrefillBatch, states: list | None, device: torch.device):
    """The batch with generators rebuilt on this rank's device from rank 0's states."""
    if states is None:
        return batch
    return dataclasses.replace(batch, sampling=restore_sampling(batch.sampling, states, device))


def restore_sampling(sb: SamplingBatch, states: list | None, device: torch.device) -> SamplingBatch:
    if states is None:
        return sb
    return dataclasses.replace(sb, generators=[None if s is None else _generator(s, device) for s in states])


def _generator(state: torch.Tensor, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.set_state(state)
    return g


def run_worker(conn, rank: int, config, hf_config, store_path: str, log_level: int) -> None:
    """The worker process's entry point (torch.multiprocessing spawn target)."""
    _exit_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # sent to the process group: the engine closes the workers in order
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
    logging.getLogger("nanoserve").setLevel(max(log_level, logging.WARNING))  # rank 0 logs start-up
    if torch.device(config.device).type == "cpu":  # the ranks share the cores; spinning threads would starve rank 0
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    try:
        send(conn, ("joining",))
        tp = connect(store_path, rank, config.tensor_parallel_size, torch.device(config.device))
        runner = ModelRunner(config, hf_config, tp)
        send(conn, ("ready", runner.info.num_kv_blocks))
        _serve(conn, runner)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(1)  # the engine is gone: nothing to report to
    except BaseException:
        try:
            send(conn, ("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # skip interpreter teardown: a peer may be gone mid-collective
    disconnect(tp)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing else to release; the interpreter's teardown of torch costs a second


def _serve(conn, runner: ModelRunner) -> None:
    pending = None  # this rank's PendingSample of a step whose sampler rank 0 deferred
    while True:
        message = recv(conn)
        kind = message[0]
        if kind == "execute":
            out = runner.execute(restore(message[1], message[2], runner.device), message[3])
            pending = out if message[3] else None
        elif kind == "sample":
            runner.sample_deferred(pending, restore_sampling(message[1], message[2], runner.device))
            pending = None
        elif kind == "call":
            _, fn, args, reply = message
            result = fn(runner, *args)
            if reply:
                send(conn, ("result", result))
        elif kind == "close":
            runner.close()
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


def _exit_with_parent() -> None:
    """A daemon thread that ends this process when the engine process exits, however it exits."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="nanoserve-parent-watch", daemon=True).start()
