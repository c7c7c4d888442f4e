"""End-to-end engine behaviour on CPU: HF parity, batching, preemption, prefix caching, errors."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from nanoserve.engine.engine import QueueFullError
from tests.engine.churn import run_chunked_batch

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, float32, one prompt at a time (no padding effects), EOS disabled."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def prompts_of_lengths(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def chunked_prefix_batch_stats(path: str, options: dict):
    """Chunks of 16 tokens, a shared 33-token prefix (cached after the first prompt) and a 22-block KV cache: the
    tokens equal transformers'; returns the engine's stats (hits, preemptions, mixed steps) for the caller's checks."""
    shared = prompts_of_lengths([33], 500, seed=5)[0]
    prompts = [shared + p for p in prompts_of_lengths([4, 9, 2, 13], 500, seed=6)]
    expected = hf_greedy(path, prompts, 12)
    with LLM(path, num_kv_blocks=22, max_num_batched_tokens=16, **dict(options, max_model_len=64)) as llm:
        assert run_chunked_batch(llm, prompts, SamplingParams(max_tokens=12, **GREEDY)) == expected
        return llm.engine.stats


def assert_two_ranks_give_one_ranks_tokens(path: str, options: dict) -> None:
    """tp=2 (gloo, CPU) generates tp=1's greedy tokens, with chunked prompts."""
    prompts = prompts_of_lengths([2, 7, 19], 500, seed=12)
    params = SamplingParams(max_tokens=8, **GREEDY)
    options = dict(options, max_num_batched_tokens=16)
    with LLM(path, **options) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def assert_batch_matches_transformers(path: str, options: dict) -> None:
    """A mixed-length greedy batch (1–30 prompt tokens, 10 new) equals transformers' tokens, and frees every block."""
    prompts = prompts_of_lengths([1, 4, 9, 17, 30], 500, seed=4)
    expected = hf_greedy(path, prompts, 10)
    assert len({tuple(t) for t in expected}) > 1
    with LLM(path, **options) as llm:
        got = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
        assert [o.token_ids for o in got] == expected
        assert llm.engine.core.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    """One small-block engine per arch (block_size 4 so prompts and generations cross many block boundaries)."""
    return {arch: LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=128, max_num_seqs=8)
            for arch, path in tiny_model_dirs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_and_batching_is_invisible(arch, engines, tiny_model_dirs):
    llm = engines[arch]
    prompts = prompts_of_lengths([1, 5, 9, 16, 23], llm.engine.vocab_size)
    params = SamplingParams(max_tokens=20, **GREEDY)
    expected = hf_greedy(tiny_model_dirs[arch], prompts, 20)
    batched = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == expected
    one_by_one = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert one_by_one == expected
    assert len(set(map(tuple, expected))) > 1, "outputs should differ across prompts (a degenerate model proves little)"
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_text_prompts_and_detokenization(engines, tiny_model_dirs):
    llm = engines["qwen3"]
    out = llm.generate("Hello there, how are you?", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    tok = llm.tokenizer
    assert out.prompt_token_ids == tok.encode("Hello there, how are you?")
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_stream_equals_generate(engines):
    llm = engines["llama"]
    params = SamplingParams(max_tokens=16, **GREEDY)
    full = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    deltas = list(llm.stream("The quick brown fox", params))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finish_reason == "length"


def test_final_only_requests_report_once_with_the_streamed_text(engines):
    """LLM.generate's requests (stream=False) are reported only when finished and detokenized once at the end;
    the text must equal what incremental detokenization streams, unicode and byte-fallback pieces included."""
    llm = engines["qwen3"]
    engine = llm.engine
    prompts = ["Hello there", "Ünïcode ✓ — text", "1 2 3 4"]
    params = SamplingParams(max_tokens=24, **GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"final-{i}", prompt, params, stream=False)
    reported = []
    while engine.has_unfinished_requests():
        reported += engine.step()
    assert sorted(o.request_id for o in reported) == [f"final-{i}" for i in range(3)]
    assert all(o.finished for o in reported)
    for out in reported:
        prompt = prompts[int(out.request_id.split("-")[1])]
        assert out.text == "".join(d.text for d in llm.stream(prompt, params))


def test_stop_strings_cut_text(engines):
    llm = engines["qwen3"]
    base = llm.generate("Once upon a time", SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0]
    stop = base.text[5:8]
    assert stop and stop.strip(), base.text
    cut = llm.generate("Once upon a time", SamplingParams(max_tokens=24, stop=[stop], **GREEDY), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    kept = llm.generate("Once upon a time", SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=True,
                                                           **GREEDY), use_tqdm=False)[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    deltas = list(llm.stream("Once upon a time", SamplingParams(max_tokens=24, stop=[stop], **GREEDY)))
    assert "".join(d.text for d in deltas) == cut.text  # streaming never leaks part of a stop string


def test_stop_token_ids_and_eos(engines):
    llm = engines["qwen2"]
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]
    stop_tok = base.token_ids[3]
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=[stop_tok], **GREEDY),
                       use_tqdm=False)[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_tok
    core = llm.engine.core
    eos = core.eos_token_ids
    core.eos_token_ids = [stop_tok]  # pretend that token is EOS: generation stops there unless ignore_eos
    try:
        stopped = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0]
        assert stopped.token_ids == base.token_ids[:first + 1] and stopped.finish_reason == "stop"
        at_least = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, min_tokens=first + 2, temperature=0.0),
                                use_tqdm=False)[0]
        assert len(at_least.token_ids) >= first + 2
    finally:
        core.eos_token_ids = eos


def test_seeds_reproduce_and_n_completions(engines):
    llm = engines["qwen3"]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([3, 4, 5], params, use_tqdm=False)[0]
    noise = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    mixed = llm.generate([[9, 9], [3, 4, 5], [1, 2, 3, 4]], [noise, params, noise], use_tqdm=False)[1]
    assert a.token_ids == mixed.token_ids
    n3 = llm.generate([3, 4, 5], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
                      use_tqdm=False)[0]
    assert [o.index for o in n3.outputs] == [0, 1, 2]
    assert n3.outputs[0].token_ids == a.token_ids  # completion i uses seed + i
    assert len({tuple(o.token_ids) for o in n3.outputs}) > 1


def test_logprobs_match_log_softmax(engines, tiny_model_dirs):
    llm = engines["llama"]
    prompt = [4, 8, 15, 16, 23, 42]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, logprobs=3, **GREEDY), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        top = torch.topk(row, 3)
        assert list(entry)[:3] == top.indices.tolist()
        for tok, lp in entry.items():
            assert lp == pytest.approx(row[tok].item(), abs=1e-4)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)), abs=1e-3)


KV_DTYPES = ["auto", "fp8"]  # the preemption and prefix-cache checks hold for an fp8 KV cache too


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_preemption_completes_every_request_with_the_same_tokens(tiny_model_dirs, kv_cache_dtype):
    path = str(tiny_model_dirs["qwen3"])
    prompts = prompts_of_lengths([6, 11, 3, 14, 9, 7, 12, 5], 500, seed=3)
    params = SamplingParams(max_tokens=24, **GREEDY)
    options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, kv_cache_dtype=kv_cache_dtype)
    roomy = LLM(path, num_kv_blocks=256, **options)
    expected = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(path, num_kv_blocks=16, enable_prefix_caching=False, **options)
    engine = tight.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, stream=False)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out.token_ids
        bm = engine.core.block_manager
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        live = list(engine.core.scheduler.running)
        assert bm.num_used_blocks == sum(len(s.block_table) for s in live)
        assert all(not s.block_table for s in engine.core.scheduler.waiting)
    assert engine.stats.preemptions > 0
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert engine.core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_prefix_cache_hits_give_the_same_tokens(tiny_model_dirs, kv_cache_dtype):
    options = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(str(tiny_model_dirs["llama"]), **options)
    shared = prompts_of_lengths([21], 500, seed=5)[0]
    prompts = [shared + [7, 8], shared + [9], shared]
    params = SamplingParams(max_tokens=10, **GREEDY)
    cold = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]  # later ones hit the cache
    assert llm.engine.stats.prefix_cache_hit_tokens >= 2 * 20
    no_cache = LLM(str(tiny_model_dirs["llama"]), enable_prefix_caching=False, **options)
    assert cold == [o.token_ids for o in no_cache.generate(prompts, params, use_tqdm=False)]
    both = llm.generate(prompts, params, use_tqdm=False)  # same step: later prompts reuse blocks filled this step
    assert [o.token_ids for o in both] == cold


def test_abort_frees_blocks(engines):
    engine = engines["qwen2"].engine
    engine.add_request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.core.block_manager.num_used_blocks > 0
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("never-existed")
    assert engine.core.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_bad_requests_raise_clear_errors(engines):
    llm = engines["llama"]
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [1] * 128, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [1, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="string or a list of token ids"):
        engine.add_request("weird", 3.5, SamplingParams())
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert engine.core.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_engine_options_are_validated(tiny_model_dirs):
    path = str(tiny_model_dirs["llama"])
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(path, device="cpu", max_num_seq=4)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, device="cpu", max_model_len=100, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        LLM(path, device="cpu", max_num_seqs=4, cudagraph_capture_sizes=[1, 8])
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, device="cpu", dtype="int8")


def test_full_waiting_queue_is_refused(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen2"]), device="cpu", max_model_len=64, max_waiting_requests=2)
    llm.engine.add_request("1", [1, 2], SamplingParams(max_tokens=2))
    llm.engine.add_request("2", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        llm.engine.add_request("3", [1, 2], SamplingParams(max_tokens=2))


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gpu_greedy_matches_transformers(arch, tiny_model_dirs):
    """float32 on CUDA with graphs: tokens identical to transformers; bf16: last-token logits within tolerance."""
    path = tiny_model_dirs[arch]
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8,
              num_kv_blocks=128, show_progress=False)
    prompts = prompts_of_lengths([1, 5, 17, 33, 40], llm.engine.vocab_size)
    params = SamplingParams(max_tokens=40, **GREEDY)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                 min_new_tokens=40, eos_token_id=None, pad_token_id=0)
        expected.append(gen[0, len(prompt):].tolist())
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.engine.stats.decode_steps_graph > 0

    bf16 = LLM(str(path), device="cuda", dtype="bfloat16", block_size=16, max_model_len=256, max_num_seqs=8,
               num_kv_blocks=128, show_progress=False)
    out = bf16.generate(prompts, SamplingParams(max_tokens=8, logprobs=5, **GREEDY), use_tqdm=False)
    errors = []
    for prompt, o in zip(prompts, out):
        ids = torch.tensor([prompt + o.token_ids], device="cuda")
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
        errors += [abs(lp - ref[step, tok].item()) for step, entry in enumerate(o.logprobs) for tok, lp in entry.items()]
    # bf16 weights against the fp32 reference; this random model's logits reach ~30, so rounding moves them by tenths
    assert sum(errors) / len(errors) < 0.5 and max(errors) < 3.0, (sum(errors) / len(errors), max(errors))
