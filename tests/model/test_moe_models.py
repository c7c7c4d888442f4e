"""Mixture-of-experts models against transformers (float32, CPU): Qwen3-MoE with a dense layer, Mixtral (its
block_sparse_moe / w1 w3 w2 names) and Qwen2-MoE (a gated shared expert, no top-k renormalization); the three
checkpoint layouts of expert weights; tensor-parallel shards of the experts; refusals."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.model.communicator import Split, TensorParallel
from nanoserve.model.loader import load_model
from nanoserve.model.moe import Experts, SparseMoE
from nanoserve.model_files import ModelLoadError, load_hf_config
from nanoserve.tiny import MOE_ARCHS, make_tiny_model
from tests.model.test_llama import TOL, PagedKV, decode_batch, hf_logits, prefill_batch, random_seqs


@pytest.fixture(scope="module")
def hf_moe(tiny_moe_dirs):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            for arch, d in tiny_moe_dirs.items()}


def ours(model_dir, tp=None):
    return load_model(model_dir, load_hf_config(model_dir), torch.float32, torch.device("cpu"), tp=tp)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@torch.inference_mode()
def test_prefill_then_decode_matches_hf(arch, tiny_moe_dirs, hf_moe):
    model = ours(tiny_moe_dirs[arch])
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    kv = PagedKV(model, num_blocks=64, block_size=4)
    prompt_lens, num_decode = [1, 3, 5, 11], 5
    full = random_seqs([n + num_decode for n in prompt_lens], model.vocab_size, seed=2)
    refs = [hf_logits(hf_moe[arch], s) for s in full]
    tables: list[list[int]] = [[] for _ in full]
    ids, pos, meta = prefill_batch(kv, tables, [s[:n] for s, n in zip(full, prompt_lens)], [0] * len(full))
    logits = model.compute_logits(model(ids, pos, meta))
    for i, rows in enumerate(logits.split(prompt_lens)):
        torch.testing.assert_close(rows, refs[i][: prompt_lens[i]], **TOL)
    for step in range(num_decode):
        positions = [n + step for n in prompt_lens]
        ids, pos, meta = decode_batch(kv, tables, [s[p] for s, p in zip(full, positions)], positions)
        logits = model.compute_logits(model(ids, pos, meta))
        for i, p in enumerate(positions):
            torch.testing.assert_close(logits[i], refs[i][p], **TOL)


def test_layers_follow_the_config(tiny_moe_dirs):
    qwen3 = ours(tiny_moe_dirs["qwen3_moe"])
    kinds = [type(layer.mlp).__name__ for layer in qwen3.model.layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"]  # mlp_only_layers=[1]
    qwen2 = ours(tiny_moe_dirs["qwen2_moe"]).model.layers[0].mlp
    assert qwen2.shared_expert is not None and qwen2.renormalize is False and qwen2.top_k == 2
    mixtral = ours(tiny_moe_dirs["mixtral"]).model.layers[0].mlp
    assert mixtral.renormalize is True and mixtral.experts.gate_up_proj.shape == (8, 2 * 48, 64)


def _stacked_copy(src, dst, per_projection: bool):
    """The same checkpoint with its experts stacked: per projection ([E, I, H] under experts.gate_proj.weight, as
    GGUF names them) or as transformers 5 keeps them (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights, out, groups = load_file(str(src / "model.safetensors")), {}, {}
    for name, t in weights.items():
        parts = name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            groups.setdefault((".".join(parts[:i + 1]), parts[i + 2]), {})[int(parts[i + 1])] = t
        else:
            out[name] = t
    for (prefix, proj), by_expert in groups.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        if per_projection:
            out[f"{prefix}.{proj}.weight"] = stacked
    if not per_projection:
        for prefix in {p for p, _ in groups}:
            gate, up, down = (torch.stack([groups[prefix, n][e] for e in sorted(groups[prefix, n])])
                              for n in ("gate_proj", "up_proj", "down_proj"))
            out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
            out[f"{prefix}.down_proj"] = down
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("per_projection", [True, False], ids=["per-projection", "transformers5"])
@pytest.mark.parametrize("tp_rank", [None, 1])
def test_stacked_layouts_load_the_same_weights(tiny_moe_dirs, tmp_path, per_projection, tp_rank):
    src = tiny_moe_dirs["qwen2_moe"]
    copy = _stacked_copy(src, tmp_path / "stacked", per_projection)
    tp = None if tp_rank is None else TensorParallel(tp_rank, 2, group=object())
    a, b = ours(src, tp), ours(copy, tp)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


def test_experts_shard_by_intermediate_columns(tiny_moe_dirs):
    """Rank r of 2 holds every expert's gate rows r·I/2.., up rows I + r·I/2.. and down columns r·I/2..."""
    full = ours(tiny_moe_dirs["qwen3_moe"]).model.layers[0].mlp.experts
    inter = full.down_proj.shape[2]
    for rank in (0, 1):
        part = ours(tiny_moe_dirs["qwen3_moe"], TensorParallel(rank, 2, group=object())).model.layers[0].mlp.experts
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        up = slice(inter + half.start, inter + half.stop)
        assert torch.equal(part.gate_up_proj, torch.cat([full.gate_up_proj[:, half], full.gate_up_proj[:, up]], 1))
        assert torch.equal(part.down_proj, full.down_proj[:, :, half])


def test_experts_module_names_every_expert_tensor():
    experts = Experts(3, 8, Split(4, 0, 4), torch.float32)
    assert experts.hf_names("m.experts", "down_proj") == [f"m.experts.{e}.down_proj.weight" for e in range(3)]
    assert len(experts.hf_names("m.experts", "gate_up_proj")) == 6


def test_a_missing_expert_is_named(tiny_moe_dirs, tmp_path):
    src = tiny_moe_dirs["mixtral"]
    dst = tmp_path / "broken"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        ours(dst)


@pytest.mark.parametrize("arch, why", [("DeepseekV3ForCausalLM", "multi-head latent attention"),
                                       ("GptOssForCausalLM", "attention sinks and MXFP4"),
                                       ("DbrxForCausalLM", "DBRX")])
def test_other_moe_architectures_are_one_line_refusals(tiny_moe_dirs, tmp_path, arch, why):
    dst = tmp_path / arch
    dst.mkdir()
    config = json.loads((tiny_moe_dirs["mixtral"] / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, architectures=[arch])))
    with pytest.raises(ModelLoadError) as e:
        load_hf_config(dst)
    assert why in str(e.value) and "\n" not in str(e.value) and "Qwen3MoeForCausalLM" in str(e.value)


def test_fp8_quantization_of_experts_is_refused(tiny_moe_dirs):
    path = tiny_moe_dirs["qwen3_moe"]
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        load_model(path, load_hf_config(path), torch.float32, "cpu", quantization="fp8")


def test_tiny_moe_models_are_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen2_moe")
    b = make_tiny_model(tmp_path / "b", "qwen2_moe")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("rows", [1, 2, 9])  # the gemv path, then the grouped one (kernels/moe.py's moe_path)
@torch.inference_mode()
def test_moe_blocks_in_triton_equal_transformers(arch, rows, tiny_moe_dirs, hf_moe):
    """Each sparse layer's block through the Triton kernels (the interpreter on CPU) equals transformers' block."""
    from nanoserve.kernels.switches import switched

    model = ours(tiny_moe_dirs[arch])
    g = torch.Generator().manual_seed(rows)
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        x, residual = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        hf_layer = hf_moe[arch].model.layers[i]
        want = hf_layer.mlp(hf_layer.post_attention_layernorm(x + residual)[None])[0]
        with switched(force_triton=True):
            got, new_residual = layer.mlp(x, residual, layer.post_attention_layernorm)
        torch.testing.assert_close(new_residual, x + residual)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_progress_counts_what_a_stacked_tensor_fills(tiny_moe_dirs, tmp_path):
    """The loading bar's total is the per-expert names; a stacked tensor advances it by every expert it fills."""
    from nanoserve.model import loader
    from nanoserve.model.llama import LlamaForCausalLM
    from nanoserve.model.weights import hf_names

    copy = _stacked_copy(tiny_moe_dirs["qwen3_moe"], tmp_path / "stacked", per_projection=False)
    config = load_hf_config(copy)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, torch.float32)
    total = len(hf_names(model, dict(model.named_parameters())))
    counted: list[int] = []
    loader._load_safetensors(model, copy, config, torch.float32, torch.device("cpu"), counted.append)
    assert sum(counted) == total and len(counted) < total
