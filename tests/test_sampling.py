"""SamplingParams validation and the batched device sampler (CPU; one GPU test for the seeded path).

The sampler is driven the way the engine drives it: engine/batching.py's sampling_batch turns the
sequences into per-row arrays, runner/sampler.py samples them and reads the result back."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from nanoserve.engine.batching import sampling_batch
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.engine.sequence import Sequence
from nanoserve.runner.sampler import Sampler, SampledTokens, SamplingTensors, apply_penalties
from nanoserve.sampling import SamplingParams


def Seq(params: SamplingParams, prompt_token_ids=None, output_token_ids=None, generator=None) -> Sequence:
    return Sequence("r", list(prompt_token_ids or [0]), params, output_token_ids=list(output_token_ids or []),
                    generator=generator)


def seqs_of(params: SamplingParams, n: int) -> list[Sequence]:
    return [Seq(params) for _ in range(n)]


def sampler(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> SampledTokens:
    """One sampling step of these sequences (each the row of its index), as the engine runs it."""
    for i, s in enumerate(seqs):
        s.slot, s.num_pending = i, 1  # the token being sampled counts as pending, as after scheduling
    batch = sampling_batch(seqs, eos_token_ids)
    dev = logits.device
    params = SamplingTensors(*(torch.from_numpy(a).to(dev) for a in
                               (batch.temperature, batch.top_p, batch.top_k, batch.min_p)))
    last = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=dev)
    slots = torch.arange(len(seqs), dtype=torch.int32, device=dev)
    out = Sampler(len(seqs), dev)(logits, batch, params, last, slots).result()
    assert last[:len(seqs)].tolist() == out.token_ids  # the next step's inputs, on the device
    for s in seqs:
        s.num_pending = 0
    return out


# ---------------------------------------------------------------- SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (16, 0, [], [], False, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.include_stop_str_in_output and p.skip_special_tokens and not p.greedy and not p.uses_penalties


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(7, 8), top_k=-1, temperature=0, max_tokens=None)
    assert p.stop == ["###"] and p.stop_token_ids == [7, 8] and p.top_k == 0 and p.greedy
    assert isinstance(p.temperature, float) and p.max_tokens is None
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("kwargs, name", [
    (dict(n=0), "n"), (dict(n=129), "n"), (dict(n=True), "n"), (dict(n=1.5), "n"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature="0.5"), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=None), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p="1"), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(seed="42"), "seed"), (dict(seed=1.0), "seed"), (dict(seed=2**64), "seed"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=3.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(stop=""), "stop"), (dict(stop=["ok", ""]), "stop"), (dict(stop=[1]), "stop"), (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=["2"]), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output"),
])
def test_validation_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        SamplingParams(**kwargs)


def test_valid_edges_accepted():
    SamplingParams(n=128, temperature=0, top_p=1, top_k=5, min_p=1, seed=-3, max_tokens=1, min_tokens=1,
                   logprobs=20, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5)


def test_make_generator():
    assert SamplingParams().make_generator("cpu") is None
    p = SamplingParams(seed=123)
    a, b, c = p.make_generator("cpu"), p.make_generator("cpu"), SamplingParams(seed=124).make_generator("cpu")
    ra, rb, rc = (torch.rand(8, generator=g) for g in (a, b, c))
    assert torch.equal(ra, rb) and not torch.equal(ra, rc)


# ---------------------------------------------------------------- Sampler: greedy and filters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = logits.float().argmax(-1).tolist()
    out = sampler(logits, seqs_of(SamplingParams(temperature=0), 6), eos_token_ids=[1])
    assert out.token_ids == expected and out.logprobs is None and out.top_logprobs is None
    # slow path (logprobs asked) gives the same tokens
    out = sampler(logits, seqs_of(SamplingParams(temperature=0, logprobs=2), 6), eos_token_ids=[1])
    assert out.token_ids == expected


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logit rows"):
        sampler(torch.zeros(2, 5), seqs_of(SamplingParams(), 3), [0])


PROBS = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.05])


def draw(params: SamplingParams, logits_row: torch.Tensor, n: int = 4000, eos: tuple[int, ...] = ()) -> torch.Tensor:
    """n independent samples of one row (one batched call: n identical rows)."""
    out = sampler(logits_row.expand(n, -1).contiguous(), seqs_of(params, n), eos_token_ids=list(eos))
    return torch.tensor(out.token_ids)


@pytest.mark.parametrize("kwargs, allowed", [
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_k=1), {0}),
    (dict(top_p=0.75), {0, 1, 2}),  # mass before token 2 is 0.70 < 0.75, before token 3 is 0.85
    (dict(top_p=0.5), {0, 1}),
    (dict(top_p=0.01), {0}),  # always keeps at least one token
    (dict(min_p=0.3), {0, 1, 2}),  # keeps p >= 0.3 * 0.40 = 0.12
    (dict(min_p=0.8), {0}),
    (dict(top_k=4, top_p=0.6), {0, 1}),  # after top-k: 0.42, 0.32, ... mass before token 2 is 0.74
    (dict(top_k=4, min_p=0.2), {0, 1, 2, 3}),  # min_p floor 0.08: 0.05 is already gone by top-k
    (dict(), {0, 1, 2, 3, 4}),
])
def test_filters_sample_only_and_all_of_the_allowed_set(kwargs, allowed):
    # a permutation so that "allowed" is not simply the lowest ids
    perm = torch.tensor([3, 0, 4, 1, 2])
    logits = torch.empty(5)
    logits[perm] = PROBS.log()
    tokens = draw(SamplingParams(**kwargs), logits * 1.0)
    seen = set(tokens.tolist())
    assert seen == {perm[i].item() for i in allowed}


def test_top_k_and_top_p_mixed_rows_in_one_batch():
    logits = PROBS.log().expand(6, -1).contiguous()
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams(),
              SamplingParams(min_p=0.8), SamplingParams(temperature=0), SamplingParams(top_k=2, top_p=0.99)]
    seen = [set() for _ in params]
    for _ in range(300):
        for i, t in enumerate(sampler(logits, [Seq(p) for p in params], []).token_ids):
            seen[i].add(t)
    assert seen == [{0}, {0, 1}, {0, 1, 2, 3, 4}, {0}, {0}, {0, 1}]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    tokens = draw(SamplingParams(temperature=temperature), logits, n=40000)
    empirical = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    expected = torch.softmax(logits / temperature, dim=-1)
    assert (empirical - expected).abs().max().item() < 0.015, (empirical, expected)


# ---------------------------------------------------------------- seeds


def run_steps(rows: list[tuple[SamplingParams, int | None]], target: int, steps: int = 6) -> list[int]:
    """Sample `steps` tokens for a batch; rows are (params, seed for a fresh generator); returns row target's."""
    torch.manual_seed(len(rows) * 1000 + target)  # the default RNG differs between runs on purpose
    logits_gen = torch.Generator().manual_seed(7)
    seqs = [Seq(p, generator=None if s is None else torch.Generator().manual_seed(s)) for p, s in rows]
    got = []
    for _ in range(steps):
        base = torch.randn(64, generator=logits_gen)
        logits = base.expand(len(rows), -1) + 0.1 * torch.randn(len(rows), 64)
        logits[target] = base  # the target row's logits are the same in every run
        tokens = sampler(logits, seqs, eos_token_ids=[]).token_ids
        for s, t in zip(seqs, tokens):
            s.output_token_ids.append(t)
        got.append(tokens[target])
    return got


def test_seeded_row_is_independent_of_the_batch():
    p = SamplingParams(seed=1234, top_k=40, top_p=0.95, temperature=1.3, logprobs=3)
    alone = run_steps([(p, 1234)], target=0)
    others = [(SamplingParams(seed=99), 99), (SamplingParams(), None), (SamplingParams(temperature=0), None),
              (SamplingParams(repetition_penalty=1.3, logprobs=1), None)]
    mixed = run_steps(others[:2] + [(p, 1234)] + others[2:], target=2)
    mixed_other_order = run_steps([(p, 1234)] + others[::-1], target=0)
    assert alone == mixed == mixed_other_order
    assert run_steps([(SamplingParams(seed=4321), 4321)], target=0) != alone  # the seed matters


def test_unseeded_rows_use_the_default_rng():
    logits = torch.zeros(1, 1000)
    torch.manual_seed(5)
    a = sampler(logits, seqs_of(SamplingParams(), 1), []).token_ids
    torch.manual_seed(5)
    b = sampler(logits, seqs_of(SamplingParams(), 1), []).token_ids
    c = sampler(logits, seqs_of(SamplingParams(), 1), []).token_ids
    d = sampler(logits, seqs_of(SamplingParams(), 1), []).token_ids
    assert a == b and len({b[0], c[0], d[0]}) > 1


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(dtype):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)).to(dtype)
    params = [SamplingParams(logprobs=0), SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5),
              SamplingParams(), SamplingParams(logprobs=20, temperature=0, presence_penalty=1.0)]
    seqs = [Seq(p, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5]) for p in params]
    out = sampler(logits, seqs, eos_token_ids=[0])
    ref = torch.log_softmax(logits.float(), dim=-1)  # raw: before penalties and temperature
    assert isinstance(out, SampledTokens) and len(out.logprobs) == 4
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-6)
    assert out.top_logprobs[0] == [] and out.top_logprobs[2] == []
    for i, n in ((1, 5), (3, 20)):
        vals, ids = ref[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)


def test_top_logprobs_capped_by_vocab():
    out = sampler(torch.randn(1, 3), seqs_of(SamplingParams(logprobs=10), 1), [])
    assert len(out.top_logprobs[0]) == 3


# ---------------------------------------------------------------- penalties and min_tokens


def reference_penalties(logits: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
    out = logits.clone()
    for i, s in enumerate(seqs):
        p = s.params
        for t in set(s.prompt_token_ids) | set(s.output_token_ids):
            x = out[i, t].item()
            out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(s.output_token_ids):
            out[i, t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
    return out


def random_penalty_batch(seed: int, vocab: int = 30) -> tuple[torch.Tensor, list[Seq]]:
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(vocab, (n,), generator=g).tolist()

    seqs = [
        Seq(SamplingParams(repetition_penalty=1.8), ids(7), ids(4)),
        Seq(SamplingParams(presence_penalty=1.5, frequency_penalty=0.7), ids(3), ids(12)),
        Seq(SamplingParams(repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=-1.0), ids(15), []),
        Seq(SamplingParams(), ids(5), ids(5)),  # no penalties: untouched
        Seq(SamplingParams(repetition_penalty=1.3, frequency_penalty=2.0), ids(1), ids(9)),
    ]
    return torch.randn(len(seqs), vocab, generator=g) * 3, seqs


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_loop_reference(seed):
    logits, seqs = random_penalty_batch(seed)
    expected = reference_penalties(logits, seqs)
    got = logits.clone()
    for i, s in enumerate(seqs):
        s.slot, s.num_pending = i, 1
    apply_penalties(got, sampling_batch(seqs, []).penalties)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[3], logits[3])
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_uses_penalised_logits(seed):
    logits, seqs = random_penalty_batch(seed)
    for s in seqs:
        s.params.temperature = 0.0
    assert sampler(logits, seqs, []).token_ids == reference_penalties(logits, seqs).argmax(-1).tolist()


def test_repetition_penalty_steers_greedy_away():
    logits = torch.tensor([[3.0, 2.9, -5.0]])
    seq = Seq(SamplingParams(temperature=0, repetition_penalty=1.2), prompt_token_ids=[0])
    assert sampler(logits, [seq], []).token_ids == [1]
    assert sampler(logits, [Seq(SamplingParams(temperature=0), [0])], []).token_ids == [0]


def test_min_tokens_blocks_eos_and_stop_token_ids():
    eos, stop_id = 5, 6
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop_id], logits[0, 2] = 100.0, 90.0, 1.0
    seq = Seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop_id]))
    assert sampler(logits, [seq], [eos]).token_ids == [2]
    seq.output_token_ids = [2]
    assert sampler(logits, [seq], [eos]).token_ids == [2]
    seq.output_token_ids = [2, 2]  # min_tokens reached
    assert sampler(logits, [seq], [eos]).token_ids == [eos]
    # sampled rows are blocked too, every time
    seq = Seq(SamplingParams(min_tokens=3, stop_token_ids=[stop_id]))
    drawn = set(draw(seq.params, logits[0], n=500, eos=[eos]).tolist())
    assert eos not in drawn and stop_id not in drawn and 2 in drawn
    # ignore_eos: eos is not masked by the sampler (the engine just doesn't stop), stop ids still are
    ignoring = Seq(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[stop_id]))
    assert sampler(logits, [ignoring], [eos]).token_ids == [eos]
    logits[0, eos] = -100.0
    assert sampler(logits, [ignoring], [eos]).token_ids == [2]
    # several eos ids and an out-of-vocab stop id are fine
    multi = Seq(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[stop_id, 10**6]))
    logits[0, 3] = 200.0
    assert sampler(logits, [multi], [eos, 3]).token_ids == [2]


def test_with_real_sequence():
    from nanoserve.engine.sequence import Sequence

    p = SamplingParams(seed=11, logprobs=2)
    seq = Sequence("r", [1, 2], p, generator=p.make_generator("cpu"))
    out = sampler(torch.randn(1, 32), [seq], eos_token_ids=[0])
    assert len(out.token_ids) == 1 and len(out.top_logprobs[0]) == 2


@pytest.mark.gpu
def test_cuda_seeded_and_greedy():
    dev = torch.device("cuda")
    logits = torch.randn(3, 1000, device=dev, dtype=torch.bfloat16)
    p = SamplingParams(seed=5, top_p=0.9, logprobs=4)

    def once(batch):
        seqs = [Seq(p, generator=p.make_generator(dev))] + [Seq(SamplingParams()) for _ in range(batch - 1)]
        return sampler(logits[:batch], seqs, [0])

    a, b = once(1), once(3)
    assert a.token_ids[0] == b.token_ids[0]
    assert [t for t, _ in a.top_logprobs[0]] == [t for t, _ in b.top_logprobs[0]]
    assert [v for _, v in a.top_logprobs[0]] == pytest.approx([v for _, v in b.top_logprobs[0]], abs=1e-5)
    greedy = sampler(logits, seqs_of(SamplingParams(temperature=0), 3), [0]).token_ids
    assert greedy == logits.float().argmax(-1).tolist()
    assert math.isfinite(a.logprobs[0])



# ---------------------------------------------------------------- the one-kernel path (CUDA; here the interpreter)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.usefixtures("force_triton")
def test_plain_batches_take_the_one_kernel_and_the_others_do_not():
    """A plain batch (greedy and temperature rows, a bitmask or none) is sample_tokens' result, stored in the slots'
    cells and copied to the host; a batch with top-p takes the general path (the kernel's scratch is not touched)."""
    from nanoserve.kernels.sampling import sample_tokens_ref

    rows, vocab = 5, 300
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    seqs = [Seq(SamplingParams(temperature=t)) for t in (0.0, 0.8, 1.0, 0.0, 1.3)]
    for i, s in enumerate(seqs):
        s.slot, s.num_pending = i, 1
    s = Sampler(rows, torch.device("cpu"), torch.Generator().manual_seed(11), vocab)  # as on CUDA
    first = random.Random(11).getrandbits(31)  # the first call's noise key; each call advances it by one
    for masked in (False, True):
        batch = sampling_batch(seqs, [])
        assert batch.is_plain
        if masked:
            batch.grammar_rows = np.array([1, 2], np.int32)
            batch.grammar_bitmask = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32)
            batch.grammar_bitmask[1:3, :4] = 0  # rows 1 and 2 may not take tokens 0..127
        params = SamplingTensors(*(torch.from_numpy(a) for a in (batch.temperature, batch.top_p, batch.top_k,
                                                                   batch.min_p)))
        last = torch.full((rows + 1,), -1, dtype=torch.int32)
        got = s(logits, batch, params, last, torch.arange(rows, dtype=torch.int32)).result().token_ids
        want = sample_tokens_ref(logits, batch.grammar_bitmask, params.temperature, first + masked)
        assert got == want.tolist() == last[:rows].tolist()
        assert (got[0], got[3]) == (int(logits[0].argmax()), int(logits[3].argmax()))  # the greedy rows
        if masked:
            assert min(got[1], got[2]) >= 128
    seqs[1].params.top_p = 0.5
    batch = sampling_batch(seqs, [])
    assert not batch.is_plain
    s._fused.best.fill_(7)  # the general path leaves it alone
    params = SamplingTensors(*(torch.from_numpy(a) for a in (batch.temperature, batch.top_p, batch.top_k, batch.min_p)))
    s(logits, batch, params, torch.zeros(rows + 1, dtype=torch.int32), torch.arange(rows, dtype=torch.int32)).result()
    assert (s._fused.best == 7).all()
