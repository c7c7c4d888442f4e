"""Tensor parallelism end to end on CPU: two gloo ranks (rank 0 here, rank 1 a spawned worker) give the
one-rank engine's tokens; a dead worker is a clear error, not a hang; bad sizes are refused up front.
The GPU tests (NCCL, CUDA graphs with the all-reduce inside) are in test_tensor_parallel_gpu.py."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cli import _build_parser
from nanoserve.runner.parallel import distributed
from nanoserve.runner.parallel.group import WorkerError

OPTIONS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, max_num_seqs=8,
               max_num_batched_tokens=16)  # the 23-token prompt is prefilled in chunks, decode rows ride along


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 6, 11, 23)]


def generate_all(llm: LLM) -> dict:
    """Greedy, seeded and unseeded sampling (top-p, top-k, logprobs) and penalties (the synchronous loop)."""
    ps = prompts(llm.engine.vocab_size)
    greedy = llm.generate(ps, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, top_k=20, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, seed=7, min_p=0.05, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, repetition_penalty=1.3, ignore_eos=True)]
    sampled = llm.generate(ps, params, use_tqdm=False)
    return {"greedy": [o.token_ids for o in greedy], "sampled": [o.token_ids for o in sampled],
            "logprobs": sampled[1].logprobs}


def last_tokens(runner) -> list[int]:
    """On every rank (RunnerGroup.on_every_rank): the per-slot last sampled tokens."""
    return runner.buffers.state.last_tokens.tolist()


def process_id(runner) -> int:
    return os.getpid()


def fail_off_rank_zero(runner) -> None:
    if runner.tp.rank != 0:
        raise ZeroDivisionError("rank 1 was told to fail")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_the_one_rank_tokens(arch, tiny_model_dirs):
    path = str(tiny_model_dirs[arch])
    with LLM(path, **OPTIONS) as llm:
        want = generate_all(llm)
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as llm:
        got = generate_all(llm)
        runner = llm.engine.core.runner
        per_rank = runner.on_every_rank(last_tokens)
        assert llm.engine.stats.mixed_steps > 0
        pids = runner.on_every_rank(process_id)
    assert got["greedy"] == want["greedy"]
    assert len(set(map(tuple, want["greedy"]))) > 1
    assert got["sampled"] == want["sampled"]  # the same seeds, and unseeded rows draw from the runner's generator
    for a, b in zip(got["logprobs"], want["logprobs"]):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert per_rank[0] == per_rank[1]  # every rank sampled the same tokens into its own slots
    assert pids[0] == os.getpid() != pids[1]
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[1], 0)  # the worker is gone after close()


def test_a_killed_worker_is_a_clear_error_not_a_hang(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen2"]), tensor_parallel_size=2, **OPTIONS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    os.kill(llm.engine.core.runner.on_every_rank(process_id)[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"tensor-parallel worker rank 1 died \(exit code -9\)"):
        llm.generate([[8, 9]], params, use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerError, match="rank 1 died"):  # and stays an error
        llm.generate([[8, 9]], params, use_tqdm=False)
    llm.close()  # no hang either


def test_a_failed_worker_names_its_error(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["qwen3"]), tensor_parallel_size=2, **OPTIONS) as llm:
        with pytest.raises(WorkerError, match="rank 1 failed: ZeroDivisionError: rank 1 was told to fail"):
            llm.engine.core.runner.on_every_rank(fail_off_rank_zero)


def test_a_start_up_error_is_raised_as_itself_and_leaves_no_worker(tiny_model_dirs):
    with pytest.raises(ValueError, match="the KV cache holds 8 tokens"):  # every rank fails alike
        LLM(str(tiny_model_dirs["qwen2"]), tensor_parallel_size=2, num_kv_blocks=2, **OPTIONS)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-tp")]


class _RankZero:
    counters = "rank 0's counters"

    def replay(self) -> None:
        pass


def test_the_group_shows_rank_zeros_info_and_counters_and_nothing_else():
    """What the core reads of a runner is the same record for one rank and a group; rank 0's other methods would run
    on rank 0 alone (unmatched collectives), so the group does not forward them."""
    from nanoserve.runner.parallel.group import RunnerGroup

    group = RunnerGroup.__new__(RunnerGroup)
    group.runner, group.info = _RankZero(), "rank 0's info"
    assert group.counters == "rank 0's counters" and group.info == "rank 0's info"
    with pytest.raises(AttributeError):
        group.replay()


def test_sizes_the_model_cannot_share_are_refused_before_any_process_starts(tiny_model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=3, **OPTIONS)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=0, **OPTIONS)


def test_cpu_without_gloo_is_refused(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    with pytest.raises(ValueError, match="on CPU needs torch.distributed's gloo backend"):
        LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, **OPTIONS)


def test_fewer_gpus_than_ranks_is_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs \(cuda:0..cuda:1\), but 1 is visible"):
        distributed.check_world(SimpleNamespace(tensor_parallel_size=2, device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"needs 2 GPUs \(cuda:1..cuda:2\)"):
        distributed.check_world(SimpleNamespace(tensor_parallel_size=2, device="cuda:1"))
    distributed.check_world(SimpleNamespace(tensor_parallel_size=2, device="cuda:0"))
    assert [distributed.rank_device(SimpleNamespace(device="cuda:1"), r) for r in (0, 1)] == ["cuda:1", "cuda:2"]


def test_cli_flag_and_its_short_alias():
    for flag in ("--tensor-parallel-size", "-tp"):
        args = _build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", flag, "2"])
        assert args.tensor_parallel_size == 2
