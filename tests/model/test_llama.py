"""Model parity with Hugging Face transformers (float32, CPU): paged prefill, prefix-cached prefill and decode.

The KV cache, block tables and metadata are built here by hand, so these tests pin down the model and the
torch attention path independently of the scheduler and model runner.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from nanoserve.model.attention_metadata import AttentionMetadata
from nanoserve.model.layers import RMSNorm, RotaryEmbedding, rope_inv_freq
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.loader import load_model
from nanoserve.model_files import ModelLoadError, load_hf_config, rope_parameters

# fp32 rounding, amplified by the deliberately large random weights (logits reach ~35): measured worst
# |ours - HF| is 1.9e-4 at |logit| 26; a real bug (wrong RoPE, mask, norm, slot) moves logits by ~1 or more.
TOL = dict(atol=2e-4, rtol=2e-5)


class PagedKV:
    """A KV cache for every layer plus a trivial block allocator with shuffled (non-contiguous) block ids."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.block_size = block_size
        self.dummy_block = num_blocks - 1  # reserved, as in the engine: never given to a sequence
        self.free = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)).tolist()
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        for attn in model.attention_layers():
            # Unwritten slots hold a huge value: reading one unmasked would wreck the logits. (Not NaN: the
            # torch decode path multiplies masked-out values by a zero probability, and 0 * NaN is NaN.)
            attn.k_cache = torch.full(shape, 1e4, device=device)
            attn.v_cache = torch.full(shape, 1e4, device=device)

    def ensure(self, table: list[int], num_tokens: int) -> None:
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return torch.tensor([t + [self.dummy_block] * (width - len(t)) for t in tables], dtype=torch.int32)


def prefill_batch(kv: PagedKV, tables: list[list[int]], seqs: list[list[int]], cached: list[int]):
    """input_ids, positions, meta for prefilling seqs[i][cached[i]:], with keys of the first cached[i] already stored."""
    ids, positions, slots, q_lens = [], [], [], []
    for table, seq, c in zip(tables, seqs, cached):
        kv.ensure(table, len(seq))
        ids += seq[c:]
        positions += range(c, len(seq))
        slots += [kv.slot(table, p) for p in range(c, len(seq))]
        q_lens.append(len(seq) - c)
    ctx_lens = [len(s) for s in seqs]
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=kv.block_tables(tables),
        cu_seqlens_q=torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        has_cached_prefix=any(c > 0 for c in cached),
        query_lens_host=q_lens,
        context_lens_host=ctx_lens,
    )
    return torch.tensor(ids), torch.tensor(positions), meta


def decode_batch(kv: PagedKV, tables: list[list[int]], tokens: list[int], positions: list[int], pad_rows: int = 0):
    """One token per sequence at `positions`; pad_rows extra rows write to the dummy block like CUDA-graph padding."""
    slots = []
    for table, p in zip(tables, positions):
        kv.ensure(table, p + 1)
        slots.append(kv.slot(table, p))
    dummy_slot = kv.dummy_block * kv.block_size
    all_tables = tables + [[kv.dummy_block]] * pad_rows
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.tensor(slots + [dummy_slot] * pad_rows, dtype=torch.int64),
        context_lens=torch.tensor([p + 1 for p in positions] + [1] * pad_rows, dtype=torch.int32),
        block_tables=kv.block_tables(all_tables),
    )
    return torch.tensor(tokens + [0] * pad_rows), torch.tensor(positions + [0] * pad_rows), meta


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
            for arch, d in tiny_model_dirs.items()}


def ours(model_dir) -> LlamaForCausalLM:
    return load_model(model_dir, load_hf_config(model_dir), torch.float32, torch.device("cpu"))


@torch.inference_mode()
def hf_logits(hf_model, seq: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([seq])).logits[0]


def random_seqs(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_prefill_then_decode_matches_hf(arch, tiny_model_dirs, hf_models):
    model = ours(tiny_model_dirs[arch])
    kv = PagedKV(model, num_blocks=64, block_size=4)
    prompt_lens, num_decode = [1, 3, 4, 5, 11], 6
    full = random_seqs([n + num_decode for n in prompt_lens], model.vocab_size, seed=1)
    refs = [hf_logits(hf_models[arch], s) for s in full]
    tables: list[list[int]] = [[] for _ in full]

    ids, pos, meta = prefill_batch(kv, tables, [s[:n] for s, n in zip(full, prompt_lens)], [0] * len(full))
    logits = model.compute_logits(model(ids, pos, meta))
    assert logits.shape == (sum(prompt_lens), model.vocab_size) and logits.dtype == torch.float32
    for i, rows in enumerate(logits.split(prompt_lens)):
        torch.testing.assert_close(rows, refs[i][: prompt_lens[i]], **TOL)

    for step in range(num_decode):
        positions = [n + step for n in prompt_lens]  # crosses block boundaries at 4, 8, 12, 16
        ids, pos, meta = decode_batch(kv, tables, [s[p] for s, p in zip(full, positions)], positions)
        logits = model.compute_logits(model(ids, pos, meta))
        for i, p in enumerate(positions):
            torch.testing.assert_close(logits[i], refs[i][p], **TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_fused_kernel_paths_match_hf_in_the_interpreter(arch, tiny_model_dirs, hf_models, monkeypatch):
    """Every fusion on (RMSNorm in the GEMV prologue), with the Triton attention kernels (split-K decode
    and its merge), run by the CPU interpreter: prefill and decode logits still equal HF's."""
    pytest.importorskip("triton")
    from nanoserve.kernels import attention, gemv
    from nanoserve.kernels.switches import SWITCHES

    monkeypatch.setattr(SWITCHES, "fuse_max_m", gemv.MAX_M)  # every fusion on, for any row count
    monkeypatch.setattr(SWITCHES, "fuse_norm_min_k", 0)  # and the tiny model's 64-wide rows

    def cpu_applies(x, weight, bias, weight_scale=None):  # the kernel's own checks, minus "CUDA and half precision"
        return x.dim() == 2 and 1 <= x.shape[0] <= gemv.MAX_M and x.shape[1] % 16 == 0 == weight.shape[1] % 16
    monkeypatch.setattr(gemv, "kernel_applies", cpu_applies)
    wide = {False: gemv.GemvConfig(64, 64, programs_per_sm=0), True: gemv.GemvConfig(64, 64, use_dot=True)}
    monkeypatch.setattr(gemv, "choose", lambda m, n, k, size: (wide[m > 4], False))  # few programs: quick on CPU
    monkeypatch.setattr(attention, "decode_num_splits", lambda *shape: 2)  # partials to merge
    calls = []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: calls.append(a[5] if len(a) > 5 else k.get("prologue", 0))
                        or launch(*a, **k))
    model = ours(tiny_model_dirs[arch])
    for layer in model.attention_layers():
        layer.backend = "triton"
    kv = PagedKV(model, num_blocks=40, block_size=4)
    prompt_lens, num_decode = [2, 5], 1
    full = random_seqs([n + num_decode for n in prompt_lens], model.vocab_size, seed=4)
    refs = [hf_logits(hf_models[arch], s) for s in full]
    tables: list[list[int]] = [[] for _ in full]
    ids, pos, meta = prefill_batch(kv, tables, [s[:n] for s, n in zip(full, prompt_lens)], [0, 0])
    for i, rows in enumerate(model.compute_logits(model(ids, pos, meta)).split(prompt_lens)):
        torch.testing.assert_close(rows, refs[i][: prompt_lens[i]], **TOL)
    for step in range(num_decode):
        positions = [n + step for n in prompt_lens]
        ids, pos, meta = decode_batch(kv, tables, [s[p] for s, p in zip(full, positions)], positions)
        pad = torch.full((len(tables), 36 - meta.block_tables.shape[1]), kv.dummy_block, dtype=torch.int32)
        meta.block_tables = torch.cat([meta.block_tables, pad], dim=1)  # room for 2 splits of 64 keys
        logits = model.compute_logits(model(ids, pos, meta))
        for i, p in enumerate(positions):
            torch.testing.assert_close(logits[i], refs[i][p], **TOL)
    layers = model.num_layers * (1 + num_decode)
    assert calls.count(1) == 2 * layers  # norm prologue: the qkv projection and gate_up


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.inference_mode()
def test_prefill_after_cached_prefix_matches_hf(arch, tiny_model_dirs, hf_models):
    """The prefix-cache path: keys of the first tokens are already in the cache; only the rest is computed."""
    model = ours(tiny_model_dirs[arch])
    kv = PagedKV(model, num_blocks=32, block_size=4)
    seqs = random_seqs([13, 9], model.vocab_size, seed=2)
    tables: list[list[int]] = [[], []]
    prefix = [8, 4]
    ids, pos, meta = prefill_batch(kv, tables, [s[:c] for s, c in zip(seqs, prefix)], [0, 0])
    model(ids, pos, meta)
    ids, pos, meta = prefill_batch(kv, tables, seqs, prefix)
    assert meta.has_cached_prefix
    logits = model.compute_logits(model(ids, pos, meta))
    for i, rows in enumerate(logits.split([len(s) - c for s, c in zip(seqs, prefix)])):
        torch.testing.assert_close(rows, hf_logits(hf_models[arch], seqs[i])[prefix[i]:], **TOL)


@torch.inference_mode()
def test_padded_decode_rows_do_not_change_real_rows(tiny_model_dirs):
    """Rows that pad a batch to a CUDA-graph size write only the dummy block and do not change real rows.

    (Equal to rounding, not bitwise: a different row count may pick a different matmul blocking.)"""
    model = ours(tiny_model_dirs["qwen2"])
    kv = PagedKV(model, num_blocks=16, block_size=4)
    seqs = random_seqs([6, 3], model.vocab_size, seed=3)
    tables: list[list[int]] = [[], []]
    model(*prefill_batch(kv, tables, [s[:-1] for s in seqs], [0, 0]))
    snapshot = [a.k_cache.clone() for a in model.attention_layers()]
    positions = [len(s) - 1 for s in seqs]
    tokens = [s[-1] for s in seqs]
    plain = model.compute_logits(model(*decode_batch(kv, tables, tokens, positions)))
    padded = model.compute_logits(model(*decode_batch(kv, tables, tokens, positions, pad_rows=3)))
    torch.testing.assert_close(padded[:2], plain, **TOL)
    for attn, before in zip(model.attention_layers(), snapshot):
        real = [b for t in tables for b in t]
        changed = (attn.k_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(real) | {kv.dummy_block}


def test_model_interface(tiny_model_dirs):
    for arch, d in tiny_model_dirs.items():
        cfg = load_hf_config(d)
        model = ours(d)
        assert model.num_layers == cfg.num_hidden_layers == len(model.attention_layers())
        assert model.num_kv_heads == cfg.num_key_value_heads
        assert model.vocab_size == cfg.vocab_size
        assert model.head_dim == (32 if arch == "qwen3" else cfg.hidden_size // cfg.num_attention_heads)
        assert all(a.k_cache is None and a.backend == "torch" for a in model.attention_layers())
        assert not any(p.requires_grad for p in model.parameters())
        assert not model.training
    qwen3 = ours(tiny_model_dirs["qwen3"])
    assert qwen3.model.layers[0].self_attn.qkv_proj.weight.shape == (4 * 32 + 2 * 2 * 32, 64)
    assert qwen3.model.layers[0].self_attn.q_norm is not None
    assert ours(tiny_model_dirs["qwen2"]).model.layers[0].self_attn.qkv_proj.bias is not None
    assert ours(tiny_model_dirs["llama"]).model.layers[0].self_attn.qkv_proj.bias is None


def test_attention_without_cache_says_so(tiny_model_dirs):
    model = ours(tiny_model_dirs["llama"])
    kv = PagedKV(model, num_blocks=4, block_size=4)
    ids, pos, meta = prefill_batch(kv, [[]], [[1, 2, 3]], [0])
    model.attention_layers()[1].k_cache = None
    with pytest.raises(RuntimeError, match="no KV cache"):
        model(ids, pos, meta)


def test_rmsnorm_residual_form():
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    ref = (x + r) * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    normed, residual = norm(x, r)
    torch.testing.assert_close(normed, ref)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(norm(x + r), ref)


ROPE_CASES = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(ROPE_CASES[case])
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=scaling or None)
    params = rope_parameters(config)
    inv_freq, scale = rope_inv_freq(128, params, config.max_position_embeddings)
    if params["rope_type"] == "default":
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    torch.testing.assert_close(inv_freq, ref.float(), atol=0, rtol=1e-6)
    assert math.isclose(scale, ref_scale, rel_tol=1e-6)
    if case == "llama3":  # all three bands are present for Llama 3.1's settings
        ratio = ref / (1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128)))
        assert ratio.max() == 1.0 and ratio.min() == pytest.approx(1 / 8) and ((ratio < 1) & (ratio > 1 / 8)).any()


def test_rope_table_applies_scale_and_positions():
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(16, 256, params, torch.float32)
    inv_freq, scale = rope_inv_freq(16, params, 256)
    rows = rope.cos_sin_cache[torch.tensor([0, 5, 255])]
    assert rows.shape == (3, 32)  # [cos, cos, -sin, sin] per position
    angles = torch.tensor([0.0, 5.0, 255.0])[:, None] * inv_freq
    torch.testing.assert_close(rows[:, :8], angles.cos() * scale)
    torch.testing.assert_close(rows[:, 8:16], angles.cos() * scale)
    torch.testing.assert_close(rows[:, 16:24], -angles.sin() * scale)
    torch.testing.assert_close(rows[:, 24:], angles.sin() * scale)


@pytest.mark.parametrize("rope_type", ["dynamic", "made_up"])
def test_unsupported_rope_type_is_a_clear_error(tmp_path, tiny_model_dirs, rope_type):
    raw = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = {"rope_type": rope_type, "factor": 2.0, "original_max_position_embeddings": 1024,
                           "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=rope_type):
        load_hf_config(tmp_path)


def test_rope_setting_missing_is_named(tmp_path, tiny_model_dirs):
    raw = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    del raw["rope_parameters"]["low_freq_factor"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        load_hf_config(tmp_path)


def test_dummy_weights_need_no_files(tiny_model_dirs, tmp_path):
    cfg = load_hf_config(tiny_model_dirs["qwen3"])
    model = load_model(tmp_path / "nowhere", cfg, torch.bfloat16, torch.device("cpu"), load_format="dummy")
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    layer = model.model.layers[0]
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.self_attn.q_norm.weight == 1)
    w = layer.mlp.gate_up_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025
    again = load_model(tmp_path / "nowhere", cfg, torch.bfloat16, torch.device("cpu"), load_format="dummy")
    torch.testing.assert_close(again.model.layers[0].mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.weight)
    kv = PagedKV(model, num_blocks=8, block_size=4)
    ids, pos, meta = prefill_batch(kv, [[]], [[1, 2, 3, 4, 5]], [0])
    logits = model.compute_logits(model(ids, pos, meta))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.gpu
@torch.inference_mode()
def test_decode_forward_replays_in_cuda_graph(tiny_model_dirs):
    """The decode forward captured in a CUDA graph equals the eager forward after new inputs are copied in."""
    device = torch.device("cuda")
    d = tiny_model_dirs["qwen3"]
    model = load_model(d, load_hf_config(d), torch.float32, device)
    kv = PagedKV(model, 32, 4, device=device)
    seqs = random_seqs([7, 2, 5], model.vocab_size, seed=4)
    tables: list[list[int]] = [[], [], []]
    ids, pos, meta = prefill_batch(kv, tables, seqs, [0, 0, 0])
    meta = _to(meta, device)
    model(ids.to(device), pos.to(device), meta)
    positions = [len(s) for s in seqs]
    ids, pos, meta = decode_batch(kv, tables, [1, 2, 3], positions)
    static = [ids.to(device), pos.to(device), _to(meta, device)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.compute_logits(model(*static))  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.compute_logits(model(*static))
    new_ids, new_pos, new_meta = decode_batch(kv, tables, [9, 8, 7], positions)
    static[0].copy_(new_ids)
    static[1].copy_(new_pos)
    for name in ("slot_mapping", "context_lens", "block_tables"):
        getattr(static[2], name).copy_(getattr(new_meta, name))
    graph.replay()
    eager = model.compute_logits(model(new_ids.to(device), new_pos.to(device), _to(new_meta, device)))
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_gpu_fused_and_pdl_paths_equal_the_unfused_model(arch, tiny_model_dirs):
    """bf16 on the GPU: decode with PDL and every fusion on (for the tiny model's 64-wide rows, at all 4 rows) == with
    all of them off (to bf16 rounding)."""
    from nanoserve.kernels.switches import switched

    device = torch.device("cuda")
    d = tiny_model_dirs[arch]
    model = load_model(d, load_hf_config(d), torch.bfloat16, device)
    seqs = random_seqs([9, 3, 17, 5], model.vocab_size, seed=6)
    results = []
    for on in (True, False):
        with switched(pdl=on, fuse_norm=on, gemv_prefetch=on, fuse_norm_min_k=0, fuse_max_m=4 if on else 1):
            kv = PagedKV(model, 32, 4, device=device)
            for attn in model.attention_layers():
                attn.k_cache, attn.v_cache = attn.k_cache.bfloat16(), attn.v_cache.bfloat16()
            tables: list[list[int]] = [[] for _ in seqs]
            ids, pos, meta = prefill_batch(kv, tables, [s[:-1] for s in seqs], [0] * len(seqs))
            model(ids.to(device), pos.to(device), _to(meta, device))
            positions = [len(s) - 1 for s in seqs]
            ids, pos, meta = decode_batch(kv, tables, [s[-1] for s in seqs], positions)
            results.append(model.compute_logits(model(ids.to(device), pos.to(device), _to(meta, device))).float())
    fused_logits, plain = results
    torch.testing.assert_close(fused_logits, plain, rtol=5e-2, atol=5e-2 * plain.abs().max().item())


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    fields = dict(meta.__dict__)
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            fields[name] = value.to(device)
    return AttentionMetadata(**fields)


@torch.inference_mode()
def test_tiny_models_greedy_decode_is_varied_and_matches_hf(tiny_model_dirs, hf_models):
    """The random weights are large enough that greedy text wanders, and our greedy tokens equal HF generate()."""
    from transformers import AutoTokenizer

    for arch, d in tiny_model_dirs.items():
        tok = AutoTokenizer.from_pretrained(str(d))
        model = ours(d)
        kv = PagedKV(model, num_blocks=64, block_size=4)
        prompts = [tok.encode(p) for p in ("Hello, world!", "The capital of France is", "Write a poem")]
        tables: list[list[int]] = [[] for _ in prompts]
        logits = model.compute_logits(model(*prefill_batch(kv, tables, prompts, [0] * len(prompts))))
        last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        generated = [[t] for t in logits[last_rows].argmax(-1).tolist()]
        for _ in range(19):
            positions = [len(p) + len(g) - 1 for p, g in zip(prompts, generated)]
            logits = model.compute_logits(model(*decode_batch(kv, tables, [g[-1] for g in generated], positions)))
            for g, t in zip(generated, logits.argmax(-1).tolist()):
                g.append(t)
        for prompt, out in zip(prompts, generated):
            ref = hf_models[arch].generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert out == ref, arch
            assert len(set(out)) >= 10, (arch, out)
        assert len({tuple(g) for g in generated}) == len(prompts)


def test_make_tiny_model_is_deterministic_and_configurable(tmp_path):
    from safetensors.torch import load_file

    from nanoserve.tiny import make_tiny_model

    a = load_file(str(make_tiny_model(tmp_path / "a", "llama", seed=7) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", "llama", seed=7) / "model.safetensors"))
    c = load_file(str(make_tiny_model(tmp_path / "c", "llama", seed=8) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    d = make_tiny_model(tmp_path / "d", "llama", num_hidden_layers=3, tie_word_embeddings=True)
    model = ours(d)
    assert model.num_layers == 3 and model.lm_head is None
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path / "e", "gpt2")
