"""Tensor parallelism on two GPUs: NCCL, CUDA graphs per rank with the collectives captured inside.

Run on a 2-GPU machine with `python -m pytest -m gpu tests/runner/test_tensor_parallel_gpu.py`; skipped
unless two GPUs are visible. (NCCL's NVLink multicast stays as the machine sets it: nothing here enables it.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as torch_mp

from nanoserve import LLM, SamplingParams
from nanoserve.runner.dispatch import Kind
from nanoserve.runner.parallel import distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(device="cuda:0", dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8,
               num_kv_blocks=128, cudagraph_capture_sizes=[1, 2, 4, 8], show_progress=False)


def last_tokens(runner) -> list[int]:
    return runner.buffers.state.last_tokens.tolist()


def _captured_all_reduce(rank: int, store: str, results) -> None:
    """Each rank: an all-reduce captured in a CUDA graph sums again at every replay."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = distributed.connect(store, rank, 2, device)
    x = torch.full((1024,), float(rank + 1), device=device)
    tp.all_reduce(x)  # the warm-up creates the communicator: 1 + 2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tp.all_reduce(x)
    torch.cuda.synchronize()
    captured = x[0].item()  # capture records, runs nothing
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    results.put((rank, captured, x[0].item(), x[-1].item()))
    distributed.disconnect(tp)


def test_the_all_reduce_runs_inside_a_cuda_graph():
    ctx = torch_mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        torch_mp.spawn(_captured_all_reduce, args=(os.path.join(d, "store"), results), nprocs=2)
    got = sorted(results.get() for _ in range(2))
    assert got == [(0, 3.0, 12.0, 12.0), (1, 3.0, 12.0, 12.0)]  # 3 → 6 → 12 on both ranks


def greedy(llm: LLM) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, llm.engine.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 19, 40, 3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp32_graph_tokens_equal_one_rank(arch, tiny_model_dirs):
    path = str(tiny_model_dirs[arch])
    with LLM(path, **OPTIONS) as llm:
        want = greedy(llm)
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as llm:
        got = greedy(llm)
        stats = llm.engine.stats
        per_rank = llm.engine.core.runner.on_every_rank(last_tokens)
    assert got == want
    assert stats.decode_steps_graph > 0
    assert per_rank[0] == per_rank[1]


def test_rank_zero_graphs_hold_the_collectives(tiny_model_dirs):
    sys.path.insert(0, str(REPO))
    from benchmarks.graph_edges import kernel_names
    from benchmarks.decode_floor import kept_graphs

    with kept_graphs() as kept:
        if not kept:
            pytest.skip("this torch's CUDAGraph has no keep_graph: the graph's nodes cannot be read")
        with LLM(str(tiny_model_dirs["qwen3"]), tensor_parallel_size=2, **OPTIONS) as llm:
            runner = llm.engine.core.runner
            layers = runner.model.num_layers
            graphs = runner.runner.graphs.runners[Kind.DECODE].graphs  # rank 0's
            nccl = {b: sum("nccl" in n.lower() for n in kernel_names(g.raw_cuda_graph())) for b, g in graphs.items()}
    # per step: the embedding's all-reduce, o_proj's and down_proj's in every layer, the logits' all-gather
    assert sorted(nccl) == [1, 2, 4, 8]
    assert all(n >= 2 * layers + 2 for n in nccl.values()), nccl


def test_a_killed_worker_on_cuda_is_a_clear_error_not_a_hang(tiny_model_dirs):
    """In a subprocess: if the NCCL abort failed to unblock rank 0, the engine process exits (no pytest hang)."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from nanoserve import LLM, SamplingParams
        from nanoserve.runner.parallel.group import WorkerError

        def pid(runner):
            return os.getpid()

        if __name__ == "__main__":
            llm = LLM({str(tiny_model_dirs["qwen2"])!r}, tensor_parallel_size=2, **{OPTIONS!r})
            p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.generate([[5, 6, 7]], p, use_tqdm=False)
            os.kill(llm.engine.core.runner.on_every_rank(pid)[1], signal.SIGKILL)
            start = time.monotonic()
            try:
                for _ in range(3):
                    llm.generate([[8, 9, 10]], p, use_tqdm=False)
            except WorkerError as e:
                print("RAISED", e, round(time.monotonic() - start, 1), flush=True)
            llm.close()
            print("CLOSED", flush=True)
    """)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, f.name], capture_output=True, text=True, timeout=180, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    finally:
        os.unlink(f.name)
    assert "RAISED tensor-parallel worker rank 1 died" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "CLOSED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert time.monotonic() - start < 180
