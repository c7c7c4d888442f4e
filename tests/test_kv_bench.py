"""The fp8 KV cache benchmarks' pure parts (benchmarks/kv_cache.py, kv_quality.py, throughput.py's file name) and the
fp8 byte counts their floors and capacities rest on (benchmarks/common.py, from the engine's KVCacheSpec); main()
without a GPU prints one line and exits 0. No engine starts here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common, kv_cache, kv_quality, throughput  # noqa: E402


def test_fp8_bytes_per_token_count_codes_and_token_scales():
    cfg = common.model_config("llama-3.1-8b")  # 32 layers, 8 KV heads of 128
    bf16 = common.kv_bytes_per_token(cfg)
    layer, token = (common.kv_bytes_per_token(cfg, 1, s) for s in ("layer", "token"))
    assert (bf16, layer, token) == (32 * 8 * 2 * 128 * 2, 32 * 8 * 2 * 128, 32 * 8 * 2 * (128 + 2))
    assert bf16 / token >= kv_cache.CAPACITY_MIN and token / layer - 1 <= kv_cache.SCALE_BYTES_MAX
    assert common.kv_bytes_read(cfg, 512, 1, "token") == 512 * token
    with pytest.raises(ValueError):
        common.kv_bytes_per_token(cfg, 1)  # an fp8 cache has scales


def test_check_reads_both_directions():
    assert common.check(0.9, 1.0) == {"value": 0.9, "limit": 1.0, "met": True}
    assert common.check(0.9, 1.0, at_least=True)["met"] is False
    assert common.check(None, 1.0)["met"] is None


def _run(blocks: int, bytes_per_token: int, steps: dict, long_ms: float | None = None, block_size: int = 16) -> dict:
    rec = {"startup": {"kv_blocks": blocks, "kv_block_size": block_size, "kv_tokens": blocks * block_size,
                       "kv_bytes_per_token": bytes_per_token},
           "decode": {str(b): {"step_ms": ms} for b, ms in steps.items()}}
    if long_ms is not None:
        rec["long_context"] = {"step_ms": long_ms}
    return rec


def _report() -> dict:
    llama = {"auto": _run(1000, 131072, {1: 4.0, 64: 6.0, 256: 12.0}, 20.0),
             "fp8": _run(980, 66560, {1: 3.9, 64: 5.5, 256: 9.5}, 12.0, block_size=32),  # (fp8's default blocks)
             "fp8-layer": _run(2000, 65536, {1: 4.1, 64: 5.6, 256: 9.4}, 11.9),
             kv_cache.FP8_WEIGHTS: _run(2500, 66560, {}, 10.0)}
    qwen = {"auto": _run(100, 114688, {1: 1.0, 256: 4.0}), "fp8": {"options": {}, "error": "RuntimeError: boom"}}
    models = {name: {"runs": runs, "capacity": kv_cache.capacity(runs)}
              for name, runs in (("qwen3-0.6b", qwen), ("llama-3.1-8b", llama))}
    return {"settings": {"batch_sizes": [1, 64, 256]}, "models": models}


def test_capacity_and_targets_read_off_a_report():
    report = _report()
    cap = report["models"]["llama-3.1-8b"]["capacity"]
    assert set(cap) == {"fp8", "fp8-layer"}  # the fp8-weights run has more memory: not a KV capacity
    assert cap["fp8"] == {"tokens_ratio": pytest.approx(1.96), "bytes_ratio": pytest.approx(131072 / 66560)}
    assert report["models"]["qwen3-0.6b"]["capacity"] == {}  # its fp8 engine failed to start
    t = kv_cache.targets(report)
    assert t["llama-3.1-8b / fp8 / decode b=256 ms"] == {"value": 9.5, "limit": 10.0, "met": True}
    assert t["llama-3.1-8b / auto / decode b=256 ms"]["met"] is False
    assert t["llama-3.1-8b / fp8-layer / b=1 vs auto"]["value"] == pytest.approx(4.1 / 4.0)
    assert not t["llama-3.1-8b / fp8-layer / b=1 vs auto"]["met"] and t["llama-3.1-8b / fp8 / b=1 vs auto"]["met"]
    assert t["llama-3.1-8b / fp8 / capacity vs auto"]["met"] and t["llama-3.1-8b / fp8 / b=16 at 32768 ms"]["met"]
    assert t[f"llama-3.1-8b / {kv_cache.FP8_WEIGHTS} / b=16 at 32768 ms"] == {"value": 10.0, "limit": 10.5,
                                                                               "met": True}
    assert t["llama-3.1-8b / fp8 / scale bytes share"]["value"] == pytest.approx(2 / 128)
    assert not any(k.startswith("qwen3-0.6b / fp8") for k in t)
    assert t["qwen3-0.6b / auto / decode b=256 ms"]["met"] is False


def test_summary_table_has_a_row_per_run_and_a_line_per_target():
    report = _report()
    report["targets"] = kv_cache.targets(report)
    lines = kv_cache.summary_lines(report)
    assert lines[0].split()[:4] == ["model", "kv", "tokens", "cap"] and lines[0].split()[-1] == "b=16@32k"
    rows = [line for line in lines[1:] if not line.startswith("  ")]
    assert len(rows) == 6 and "ERROR RuntimeError: boom" in rows[1]
    assert rows[3].split()[:7] == ["llama-3.1-8b", "fp8", "31360", "1.960", "3.900", "5.500", "9.500"]
    assert len(lines) == 1 + 6 + len(report["targets"]) and "NOT met" in "\n".join(lines)


def test_forced_positions_and_comparison():
    ids = [5, 6, 7, 8]  # prompt 5, 6; continuation 7, 8
    logprobs = [None, {6: -1.0}, {7: -0.5, 9: -0.2}, {8: -0.1}]
    assert kv_quality.forced_positions(logprobs, ids, 2) == ([9, 8], [-0.5, -0.1])
    ref = [([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0]), ([5, 6], [-2.0, -2.0])]
    got = [([1, 2, 0, 4], [-1.1, -1.0, -1.0, -0.9]), ([5, 6], [-2.0, -2.4])]
    m = kv_quality.compare(ref, got)
    assert m["tokens"] == 6 and m["prompts"] == 2 and m["top1_agreement"] == pytest.approx(5 / 6)
    assert m["top1_agreement_se"] == pytest.approx(1 / 6)  # sample sd sqrt(1/6) / sqrt(6)
    assert m["top1_agreement_se_prompts"] == pytest.approx(0.125)  # prompt means 0.75 and 1.0
    assert m["mean_abs_dlogprob"] == pytest.approx(0.6 / 6) and m["max_abs_dlogprob"] == pytest.approx(0.4)
    assert kv_quality.greedy_agreement(got, [[1, 2, 3, 4], [5, 7]]) == pytest.approx(4 / 6)


def test_mean_se():
    assert kv_quality.mean_se([1.0, 3.0]) == (2.0, pytest.approx(1.0))  # sd sqrt(2) / sqrt(2)
    assert kv_quality.mean_se([0.5]) == (0.5, None)


def test_quality_targets_and_table():
    row = {"tokens": 2048, "prompts": 16, "top1_agreement": 0.98, "top1_agreement_se": 0.003,
           "mean_abs_dlogprob": 0.01, "mean_abs_dlogprob_se": 0.001, "max_abs_dlogprob": 0.5}
    short = {"fp8": row, "fp8-layer": dict(row, top1_agreement=0.96), kv_quality.FP32_REFERENCE: row}
    contexts = {"short": {"auto_vs_greedy": 0.999, "settings": short},
                "long": {"auto_vs_greedy": 1.0, "settings": {"fp8": row}}}
    t = kv_quality.targets("smollm2", contexts)
    assert t == {"short / fp8 / top-1 agreement": {"value": 0.98, "limit": 0.97, "met": True},
                 "short / fp8-layer / top-1 agreement": {"value": 0.96, "limit": 0.97, "met": False}}
    assert kv_quality.targets("llama-3.1-8b", contexts) == {}
    lines = kv_quality.table_lines(contexts, t)
    assert lines[1].split()[:5] == ["short", "fp8", "2048", "0.9800", "±"] and len(lines) == 1 + 6 + 2
    assert lines[3].split()[1] == kv_quality.FP32_REFERENCE  # a row of the table, no target
    assert lines[-1].endswith("NOT met")


def test_prompts_are_seeded_and_long_texts_are_long():
    a = kv_quality.random_prompts(1000, 4, 16, seed=3)
    assert a == kv_quality.random_prompts(1000, 4, 16, seed=3) and len(a) == 4 and {len(p) for p in a} == {16}
    assert all(10 <= t < 1000 for p in a for t in p) and a != kv_quality.random_prompts(1000, 4, 16, seed=4)
    texts = kv_quality.long_texts()
    assert len(texts) == kv_quality.LONG_PROMPTS and len(set(texts)) == len(texts)
    assert min(map(len, texts)) >= 4 * kv_quality.LONG_CONTEXT  # plenty of text for 4096 tokens of any tokenizer


def test_throughput_file_name_names_the_kv_cache():
    assert throughput.output_name() == "throughput.json"
    assert throughput.output_name("fp8") == "throughput_kv-fp8.json"
    assert throughput.output_name("fp8", "layer") == "throughput_kv-fp8-layer.json"


def test_mains_without_cuda_print_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kv_cache.main([]) == 0
    assert capsys.readouterr().out.strip() == "kv_cache.py needs a CUDA GPU"
    assert kv_quality.main(["llama-3.1-8b"]) == 0
    assert capsys.readouterr().out.strip() == "kv_quality.py llama-3.1-8b on cuda needs a CUDA GPU"
