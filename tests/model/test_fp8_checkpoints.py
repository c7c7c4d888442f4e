"""Pre-quantized FP8 checkpoints: the block-quantized `fp8` format (weight_scale_inv per 128x128 tile) and
compressed-tensors FP8 (weight_scale per channel, per tensor or per block). Each test writes a tiny model as a
checkpoint of that format; the loader must keep its codes and scales exactly, the model must equal the model on the
weights those scales define, and any other stored format is one clear line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.config import FP8_BLOCK
from nanoserve.kernels import fp8
from nanoserve.model.loader import load_model
from nanoserve.model_files import ModelLoadError, checkpoint_quantization, load_hf_config
from nanoserve.tiny import make_tiny_model
from tests.model.test_llama import PagedKV, decode_batch, prefill_batch, random_seqs
from tests.model.test_quantization import decoder_linears, load

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYOUTS = ("fp8-block", "ct-channel", "ct-tensor", "ct-block")
_CT_GROUP = {"targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "dynamic": True, "symmetric": True}}


def quantization_config(layout: str) -> dict:
    if layout == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    strategy = layout.removeprefix("ct-")
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [FP8_BLOCK, FP8_BLOCK]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": dict(_CT_GROUP, weights=weights)}, "quantization_status": "compressed"}


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, the scale tensor as the format stores it, the fp32 weight they define)."""
    if layout.endswith("block"):
        q, s = fp8.quantize(w, (FP8_BLOCK, FP8_BLOCK))
        return q, s, fp8.dequantize(q, s, block=(FP8_BLOCK, FP8_BLOCK))
    if layout == "ct-tensor":
        s = (w.abs().max() / fp8.FP8_MAX).reshape(1)
        q = (w / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
        return q, s, q.float() * s
    q, s = fp8.quantize(w)
    return q, s[:, None], fp8.dequantize(q, s)  # compressed-tensors stores channel scales as [N, 1]


def write_checkpoint(src: Path, dst: Path, layout: str, dequantized: Path | None = None) -> None:
    """src's model as a pre-quantized checkpoint at dst (and, at `dequantized`, the model on the weights its
    scales define). An input_scale per layer as static-activation checkpoints carry: the loader skips it."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    plain = dict(tensors)
    scale_name = "weight_scale_inv" if layout == "fp8-block" else "weight_scale"
    for name in list(tensors):
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS:
            q, s, w = quantize(tensors[name], layout)
            tensors[name], tensors[f"{module}.{scale_name}"], plain[name] = q, s, w
            tensors[f"{module}.input_scale"] = torch.ones(1)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization_config(layout))))
    if dequantized is not None:
        shutil.copytree(src, dequantized)
        save_file(plain, str(dequantized / "model.safetensors"))


@pytest.fixture(scope="module")
def wide_qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3 whose projections are whole 128-row blocks (q 256, k and v 128 rows; 128 / 256 columns)."""
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "qwen3", "qwen3", hidden_size=128,
                           intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def logits_of(model, seqs) -> torch.Tensor:
    kv = PagedKV(model, 16, 4)
    tables: list[list[int]] = [[] for _ in seqs]
    prefill = model.compute_logits(model(*prefill_batch(kv, tables, seqs, [0] * len(seqs))))
    decode = model.compute_logits(model(*decode_batch(kv, tables, [5] * len(seqs), [len(s) for s in seqs])))
    return torch.cat([prefill, decode])


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_checkpoint_loads_exactly_the_weights_its_scales_define(layout, wide_qwen3, tmp_path):
    ckpt, ref_dir = tmp_path / "fp8", tmp_path / "dequantized"
    write_checkpoint(wide_qwen3, ckpt, layout, ref_dir)
    model, ref = load(ckpt), load(ref_dir)
    for lin, ref_lin in zip(decoder_linears(model), decoder_linears(ref)):
        assert lin.weight.dtype == fp8.FP8_DTYPE and lin.weight_scale.dtype == torch.float32
        n, k = lin.weight.shape
        want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)) if layout.endswith("block") else (n,)
        assert tuple(lin.weight_scale.shape) == want
        block = fp8.scale_block(lin.weight, lin.weight_scale)
        torch.testing.assert_close(fp8.dequantize(lin.weight, lin.weight_scale, block=block), ref_lin.weight,
                                   rtol=0, atol=0)
    assert model.lm_head.weight.dtype == torch.float32  # the checkpoint's ignore list: stays in the serving dtype
    seqs = random_seqs([9, 4], model.vocab_size, seed=3)
    torch.testing.assert_close(logits_of(model, seqs), logits_of(ref, seqs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor"])
def test_per_channel_and_per_tensor_scales_load_for_any_shape(layout, tiny_model_dirs, tmp_path):
    """The tiny llama's 64-row k/v parts: per-channel and per-tensor scales merge anywhere."""
    write_checkpoint(tiny_model_dirs["llama"], tmp_path / "fp8", layout, tmp_path / "ref")
    model, ref = load(tmp_path / "fp8"), load(tmp_path / "ref")
    for lin, ref_lin in zip(decoder_linears(model), decoder_linears(ref)):
        torch.testing.assert_close(fp8.dequantize(lin.weight, lin.weight_scale), ref_lin.weight, rtol=0, atol=0)


def test_block_scales_off_the_block_borders_are_refused(tiny_model_dirs, tmp_path):
    write_checkpoint(tiny_model_dirs["llama"], tmp_path / "fp8", "fp8-block")
    with pytest.raises(ModelLoadError, match=r"k_proj.weight_scale_inv: merged into .*qkv_proj.weight, rows 64\.\.96 .* block borders"):
        load(tmp_path / "fp8")


def test_engine_serves_a_prequantized_checkpoint(wide_qwen3, tmp_path):
    """Through LLM (runner, sampler): greedy tokens of the block checkpoint == those of its dequantized weights."""
    from nanoserve import LLM, SamplingParams

    write_checkpoint(wide_qwen3, tmp_path / "fp8", "fp8-block", tmp_path / "ref")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = []
    for d in (tmp_path / "fp8", tmp_path / "ref"):
        with LLM(str(d), device="cpu", dtype="float32", max_model_len=128) as llm:
            outs.append([o.token_ids for o in llm.generate(["a b c", "hello"], params)])
    assert outs[0] == outs[1]


def _rewrite(ckpt: Path, change) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_or_misshaped_scales_are_named(wide_qwen3, tmp_path):
    write_checkpoint(wide_qwen3, tmp_path / "a", "ct-channel")
    _rewrite(tmp_path / "a", lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight_scale'"):
        load(tmp_path / "a")
    write_checkpoint(wide_qwen3, tmp_path / "b", "ct-channel")
    _rewrite(tmp_path / "b", lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(3)}))
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale has shape \(3,\)"):
        load(tmp_path / "b")
    plain = tmp_path / "c"
    shutil.copytree(wide_qwen3, plain)  # fp8 codes in a checkpoint that does not say how to scale them
    _rewrite(plain, lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                                        t["model.layers.0.mlp.down_proj.weight"].to(fp8.FP8_DTYPE)}))
    with pytest.raises(ModelLoadError, match="without a quantization_config"):
        load(plain)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "awq"}, "quant_method='awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "format 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "4-bit int weights with strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int"}}}}, "8-bit int"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "sparsity_config": {"format": "2:4"},
      "config_groups": {}}, "sparsity_config"),
])
def test_other_stored_formats_are_one_line_errors(quant, message, wide_qwen3, tmp_path):
    with pytest.raises(ModelLoadError, match=message) as e:
        checkpoint_quantization(quant, "config.json")
    assert "\n" not in str(e.value)
    d = tmp_path / "m"
    shutil.copytree(wide_qwen3, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
    with pytest.raises(ModelLoadError, match=message):
        load(d)


def test_the_formats_read_from_their_configs():
    block = checkpoint_quantization(quantization_config("fp8-block"), "c")
    assert (block.scale_name, block.scales) == ("weight_scale_inv", ("block",))
    assert checkpoint_quantization(quantization_config("ct-tensor"), "c").scales == ("tensor",)
    assert checkpoint_quantization({"quant_method": "fp8", "activation_scheme": "static"}, "c").scales == \
        ("tensor", "channel")
    assert checkpoint_quantization(None, "c") is None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
@torch.inference_mode()
def test_gpu_prequantized_checkpoint_decodes_near_its_dequantized_weights(layout, wide_qwen3, tmp_path, monkeypatch):
    """bf16 on the GPU: the block- and channel-scaled GEMV (decode rows) and the many-rows path (prefill) against
    the model on the dequantized weights: close with bf16 activations (W8A16 variants), near with the table's W8A8
    ones (the activations quantized too: on this random model ~10 % of the largest logit)."""
    from nanoserve.kernels import gemv

    write_checkpoint(wide_qwen3, tmp_path / "fp8", layout, tmp_path / "ref")
    want = _logits(tmp_path / "ref")
    got = _logits(tmp_path / "fp8")
    torch.testing.assert_close(got, want, rtol=0.2, atol=0.2 * want.abs().max().item())
    w8a16 = {1: ((None, "fma 8x1024 w4 st3 p0", gemv.TRITON),), 64: ((None, "dot 64x256 w4 st4 p1", gemv.TRITON),)}
    monkeypatch.setattr(gemv, "_FP8_TABLE", gemv._parsed_table(w8a16))
    got = _logits(tmp_path / "fp8")
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


def _logits(directory) -> torch.Tensor:
    """The logits of two prompts' prefill and one decode step of a checkpoint loaded on the GPU in bf16."""
    from tests.model.test_llama import _to

    device = torch.device("cuda")
    model = load(directory, torch.bfloat16, device)
    kv = PagedKV(model, 16, 4, device=device)
    for attn in model.attention_layers():
        attn.k_cache, attn.v_cache = attn.k_cache.bfloat16(), attn.v_cache.bfloat16()
    seqs, tables = random_seqs([9, 4], model.vocab_size, seed=3), [[], []]
    ids, pos, meta = prefill_batch(kv, tables, seqs, [0, 0])
    prefill = model.compute_logits(model(ids.to(device), pos.to(device), _to(meta, device)))
    ids, pos, meta = decode_batch(kv, tables, [5, 6], [len(s) for s in seqs])
    decode = model.compute_logits(model(ids.to(device), pos.to(device), _to(meta, device)))
    return torch.cat([prefill, decode]).float()


@pytest.mark.parametrize("layout,arch", [("ct-channel", "llama"), ("ct-tensor", "llama"), ("fp8-block", "wide")])
def test_two_ranks_load_their_slices_of_the_codes_and_scales(layout, arch, tiny_model_dirs, wide_qwen3, tmp_path):
    """Tensor parallelism (gloo, threads): each rank's fp8 codes and scales, and the logits, as on one rank."""
    from tests.model.test_parallel import TensorParallel, on_ranks, prefill_and_decode

    write_checkpoint(wide_qwen3 if arch == "wide" else tiny_model_dirs[arch], tmp_path / "fp8", layout)
    d = tmp_path / "fp8"
    want = prefill_and_decode(load(d))

    def run(tp: TensorParallel):
        return prefill_and_decode(load_model(d, load_hf_config(d), torch.float32, torch.device("cpu"), tp=tp))

    got = on_ranks(2, run)
    for step, ref in enumerate(want):
        torch.testing.assert_close(got[0][step], ref, rtol=1e-4, atol=1e-4)
