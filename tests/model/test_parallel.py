"""Megatron sharding of the model (model/parallel.py), in one process: each rank is a thread with its own
gloo group over an in-memory store, so the sharded forward is checked against the one-rank model without
starting processes (the engine-level test with worker processes is tests/runner/test_tensor_parallel.py)."""
from __future__ import annotations

import datetime
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_llama import TOL, PagedKV, decode_batch, prefill_batch, random_seqs

from nanoserve.model import loader
from nanoserve.model.loader import load_model
from nanoserve.model_files import ModelLoadError, load_hf_config
from nanoserve.model.communicator import TensorParallel, check_sharding, kv_head_split
from nanoserve.tiny import make_tiny_model


def load(model_dir, tp: TensorParallel | None = None):
    return load_model(model_dir, load_hf_config(model_dir), torch.float32, torch.device("cpu"), tp=tp)


def on_ranks(size: int, fn):
    """fn(tp) on `size` threads, each rank with its own gloo group; the per-rank results."""
    store, results, errors = dist.HashStore(), [None] * size, []

    def body(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=60))
            results[rank] = fn(TensorParallel(rank, size, group))
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@torch.inference_mode()
def prefill_and_decode(model, steps: int = 4) -> list[torch.Tensor]:
    """Logits of a paged prefill of five prompts, then `steps` decode steps (same inputs on every call)."""
    kv = PagedKV(model, num_blocks=48, block_size=4)
    lens = [1, 3, 4, 6, 9]
    seqs = random_seqs([n + steps for n in lens], model.vocab_size, seed=3)
    tables: list[list[int]] = [[] for _ in seqs]
    ids, pos, meta = prefill_batch(kv, tables, [s[:n] for s, n in zip(seqs, lens)], [0] * len(seqs))
    out = [model.compute_logits(model(ids, pos, meta))]
    for step in range(steps):
        positions = [n + step for n in lens]
        ids, pos, meta = decode_batch(kv, tables, [s[p] for s, p in zip(seqs, positions)], positions)
        out.append(model.compute_logits(model(ids, pos, meta)))
    return out


@pytest.fixture(scope="module")
def biased_models(tmp_path_factory):
    """Variants the default tiny models do not cover: one KV head (replicated over two ranks), and o_proj /
    MLP biases (a row-parallel bias must be added once)."""
    root = tmp_path_factory.mktemp("tp_models")
    return {"llama-1kv-bias": make_tiny_model(root / "a", "llama", num_key_value_heads=1, attention_bias=True,
                                              mlp_bias=True),
            "qwen3-4kv": make_tiny_model(root / "b", "qwen3", num_key_value_heads=4)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-1kv-bias", "qwen3-4kv"])
def test_two_ranks_compute_the_one_rank_logits(arch, tiny_model_dirs, biased_models):
    d = {**tiny_model_dirs, **biased_models}[arch]
    want = prefill_and_decode(load(d))
    got = on_ranks(2, lambda tp: prefill_and_decode(load(d, tp)))
    for step, ref in enumerate(want):
        torch.testing.assert_close(got[0][step], ref, **TOL)
        assert torch.equal(got[0][step], got[1][step]), "ranks must see identical logits to sample alike"


def test_kv_heads_split_or_replicate():
    ranks = lambda kv, n: [kv_head_split(kv, TensorParallel(r, n, group=object())) for r in range(n)]  # noqa: E731
    assert [(s.start, s.stop) for s in ranks(8, 2)] == [(0, 4), (4, 8)]
    assert [(s.start, s.stop) for s in ranks(2, 4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [(s.start, s.stop) for s in ranks(1, 2)] == [(0, 1), (0, 1)]


class _ReadLog:
    """safe_open wrapper recording how many elements each tensor read returned."""

    def __init__(self, real, log):
        self._real, self._log = real, log

    def __enter__(self):
        self._f = self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        self._log.append((name, "whole", t.numel()))
        return t

    def get_slice(self, name):
        real, log = self._f.get_slice(name), self._log

        class Slice:
            def get_shape(self):
                return real.get_shape()

            def __getitem__(self, index):
                t = real[index]
                log.append((name, "slice", t.numel()))
                return t
        return Slice()


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_slices(rank, tiny_model_dirs, monkeypatch):
    d = tiny_model_dirs["qwen2"]  # tied embeddings, qkv bias
    real_open, log = loader.safe_open, []
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _ReadLog(real_open(*a, **k), log))
    model = load(d, TensorParallel(rank, 2, group=object()))  # loading runs no collective
    hf = load_file(str(d / "model.safetensors"))
    read = {name: (how, n) for name, how, n in log}
    for name, t in hf.items():
        how, n = read[name]
        if name.endswith("norm.weight"):
            assert (how, n) == ("whole", t.numel()), name  # replicated
        else:
            assert how == "slice" and n == t.numel() // 2, (name, how, n)  # half of every matrix and qkv bias
    assert sum(p.numel() for p in model.parameters()) < sum(t.numel() for t in hf.values())

    p, half = "model.layers.1.", slice(rank * 32, (rank + 1) * 32)  # 2 of 4 q heads, 1 of 2 kv heads (d = 16)
    layer = model.model.layers[1]
    qkv = torch.cat([hf[p + "self_attn.q_proj.weight"][rank * 32:(rank + 1) * 32],
                     hf[p + "self_attn.k_proj.weight"][rank * 16:(rank + 1) * 16],
                     hf[p + "self_attn.v_proj.weight"][rank * 16:(rank + 1) * 16]])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.self_attn.o_proj.weight, hf[p + "self_attn.o_proj.weight"][:, half])
    inter = slice(rank * 64, (rank + 1) * 64)
    gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"][inter], hf[p + "mlp.up_proj.weight"][inter]])
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(layer.mlp.down_proj.weight, hf[p + "mlp.down_proj.weight"][:, inter])
    assert torch.equal(model.model.embed_tokens.weight, hf["model.embed_tokens.weight"][rank * 256:(rank + 1) * 256])


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_bias_lives_on_rank_zero(rank, biased_models):
    d = biased_models["llama-1kv-bias"]
    hf = load_file(str(d / "model.safetensors"))
    o = load(d, TensorParallel(rank, 2, group=object())).model.layers[0].self_attn.o_proj
    assert torch.equal(o.bias, hf["model.layers.0.self_attn.o_proj.bias"] if rank == 0 else torch.zeros_like(o.bias))


def spec(heads=4, kv=2, inter=128, vocab=512):
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv, intermediate_size=inter, vocab_size=vocab, moe=None,
                           qk_norm=None)


@pytest.mark.parametrize("spec_, size, message", [
    (spec(heads=4), 3, "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    (spec(heads=8, kv=6), 4, "tensor_parallel_size=4 does not divide num_key_value_heads=6"),
    (spec(heads=12, kv=3), 4, "not a multiple of num_key_value_heads=3"),
    (spec(heads=8, kv=8, inter=100), 8, "does not divide intermediate_size=100"),
    (spec(vocab=511), 2, "does not divide vocab_size=511"),
])
def test_sharding_errors_name_the_dimension(spec_, size, message):
    with pytest.raises(ValueError, match=message):
        check_sharding(spec_, size)
    check_sharding(spec_, 1)


def test_a_model_the_ranks_cannot_share_is_a_load_error(tiny_model_dirs):
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        load(tiny_model_dirs["llama"], TensorParallel(0, 3, group=object()))
