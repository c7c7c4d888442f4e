"""MoE kernels (kernels/moe.py, moe_gemm.py) == their PyTorch references: the router's top-k, align_blocks' sort into
expert blocks, and both expert paths (gemv, grouped) against fused_experts_ref, which is itself checked against the
dense formula. CPU: through TRITON_INTERPRET=1 (set in conftest); with CUDA the same cases compile for the GPU, and
the CUDA-only tests add the Qwen3-30B-A3B layer shape and CUDA-graph replay.
"""
import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import moe, moe_gemm
from nanoserve.kernels._triton import HAS_TRITON
from nanoserve.kernels.switches import switched

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def make_experts(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=0, device=DEVICE):
    """x, w13, w2 scaled so every product is O(1), and a routing of the tokens (weights fp32, ids int32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = moe.route_ref(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    return (*(t.to(device, dtype) for t in (x, w13, w2)), weights.to(device), ids.to(device))


# -- routing ---------------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.usefixtures("force_triton")
def test_route_matches_the_reference(num_experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(num_experts * 10 + top_k)
    random = torch.randn(4, num_experts, generator=g)
    tied = torch.randint(0, 3, (3, num_experts), generator=g).float()  # many equal logits: ties to the lower id
    logits = torch.cat([random, tied, torch.zeros(1, num_experts)]).to(DEVICE, dtype)
    weights, ids = moe.route(logits, top_k, renormalize)
    want_weights, want_ids = moe.route_ref(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (8, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    assert ids[-1].tolist() == list(range(top_k))  # all equal: the lowest ids, in order


def test_route_ref_is_softmax_then_topk():
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    weights, ids = moe.route_ref(logits, 4, renormalize=False)
    want_weights, want_ids = torch.topk(torch.softmax(logits.float(), -1), 4)
    assert torch.equal(ids, want_ids.int()) and torch.equal(weights, want_weights)
    normed, _ = moe.route_ref(logits, 4, renormalize=True)
    torch.testing.assert_close(normed, want_weights / want_weights.sum(-1, keepdim=True))


# -- align_blocks ----------------------------------------------------------------------------------------------------
def check_alignment(sorted_pairs, block_expert, num_padded, ids, num_experts, block_m):
    """The contract of align_blocks, read off its outputs (independently of the reference)."""
    flat = ids.flatten().long().cpu()
    num_pairs = flat.numel()
    sorted_pairs, block_expert, total = sorted_pairs.long().cpu(), block_expert.long().cpu(), int(num_padded)
    max_padded, max_blocks = moe.align_sizes(num_pairs, num_experts, block_m)
    assert sorted_pairs.shape == (max_padded,) and block_expert.shape == (max_blocks,) and num_padded.shape == (1,)
    counts = torch.bincount(flat, minlength=num_experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum()) and total % block_m == 0
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs))  # every pair exactly once
    assert (sorted_pairs[sorted_pairs >= num_pairs] == num_pairs).all() and (sorted_pairs[total:] == num_pairs).all()
    blocks = block_expert[:total // block_m]
    assert (block_expert[total // block_m:] == -1).all() and (blocks >= 0).all()
    assert (blocks[1:] >= blocks[:-1]).all()  # experts in id order: each expert's blocks contiguous
    for b, expert in enumerate(blocks.tolist()):
        slots = sorted_pairs[b * block_m:(b + 1) * block_m]
        pairs = slots[slots < num_pairs]
        assert (flat[pairs] == expert).all() and len(pairs)  # one expert a block, no block all padding
        assert (slots[:len(pairs)] == pairs).all() and (pairs[1:] > pairs[:-1]).all()  # pair order, padding last


@needs_triton
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("num_tokens, top_k, num_experts, used", [
    (1, 1, 4, 4), (3, 2, 8, 8), (17, 4, 64, 64), (40, 2, 60, 7), (75, 4, 16, 16), (150, 2, 32, 3), (1, 8, 64, 64)])
@pytest.mark.usefixtures("force_triton")
def test_align_blocks(num_tokens, top_k, num_experts, used, block_m):
    """Experts drawn from the first `used` ids (the others get no pair); pair counts 1..300."""
    g = torch.Generator().manual_seed(num_tokens * top_k)
    scores = torch.rand(num_tokens, used, generator=g)
    ids = torch.topk(scores, top_k).indices.to(DEVICE, torch.int32)
    out = moe.align_blocks(ids, num_experts, block_m)
    check_alignment(*out, ids, num_experts, block_m)
    want = moe.align_blocks_ref(ids, num_experts, block_m)
    check_alignment(*want, ids, num_experts, block_m)
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


@needs_triton
@pytest.mark.parametrize("num_tokens, top_k, num_experts, used, block_m", [(40, 2, 60, 7, 4), (75, 4, 16, 16, 16)])
@pytest.mark.usefixtures("force_triton")
def test_align_blocks_over_many_chunks(num_tokens, top_k, num_experts, used, block_m, monkeypatch):
    """Scans of several chunks (the running position), an expert's blocks and the tail over several steps."""
    monkeypatch.setattr(moe, "ALIGN_CHUNK", 8)
    test_align_blocks(num_tokens, top_k, num_experts, used, block_m)


# -- the experts -----------------------------------------------------------------------------------------------------
def test_ref_is_the_dense_formula():
    x, w13, w2, weights, ids = make_experts(5, 24, 8, 6, 2, torch.float32, device="cpu")
    gate, up = torch.einsum("th,eih->tei", x, w13).chunk(2, dim=-1)  # every expert for every token
    per_expert = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2)
    want = (per_expert.gather(1, ids.long()[:, :, None].expand(-1, -1, 24)) * weights[:, :, None]).sum(1)
    torch.testing.assert_close(moe.fused_experts_ref(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


SHAPES = [  # (tokens, hidden, inter, experts, top_k): non-power-of-two sizes, masked tiles, experts without tokens
    (1, 64, 32, 4, 1), (1, 96, 48, 60, 4), (3, 80, 48, 8, 2), (3, 64, 32, 60, 4), (17, 80, 48, 4, 2),
    (17, 64, 32, 8, 4)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-k{}".format(*s))
@pytest.mark.parametrize("path", ["gemv", "grouped"])
@pytest.mark.usefixtures("force_triton")
def test_each_path_matches_the_reference(path, shape, dtype):
    num_tokens, hidden, inter, num_experts, top_k = shape
    x, w13, w2, weights, ids = make_experts(*shape, dtype, seed=sum(shape))
    run = moe.gemv_experts if path == "gemv" else moe.grouped_experts
    out = run(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, moe.fused_experts_ref(x, w13, w2, weights, ids), **tol(dtype))


def test_moe_path_rule():
    assert moe.moe_path(1, 8, 128) == moe.moe_path(2, 8, 8) == moe.GEMV  # decode: a token or two
    assert moe.moe_path(4, 8, 128) == moe.GEMV and moe.moe_path(5, 8, 128) == moe.GROUPED  # pairs <= E / 4
    assert moe.moe_path(3, 2, 8) == moe.GROUPED and moe.moe_path(3, 1, 16) == moe.GEMV
    assert moe.moe_path(32, 8, 1024) == moe.GEMV and moe.moe_path(33, 8, 1024) == moe.GROUPED  # clamped
    assert moe.moe_path(4096, 8, 128) == moe.GROUPED


def test_grouped_tiles():
    """Both products of a call share block_m (one align_blocks); it grows with the pairs per expert."""
    cuda = torch.device("cuda")  # only its type is read
    for pairs_per_expert, block_m in ((0.5, 16), (16, 16), (17, 64), (255, 64), (256, 128), (4096, 128)):
        up = moe_gemm.grouped_tiles(pairs_per_expert, 768, 2048, torch.bfloat16, cuda)
        down = moe_gemm.grouped_tiles(pairs_per_expert, 2048, 768, torch.bfloat16, cuda)
        assert up.block_m == down.block_m == block_m
    assert moe_gemm.grouped_tiles(64, 2048, 768, torch.float32, cuda).block_k == 32  # same bytes a stage as bf16
    tiny = moe_gemm.grouped_tiles(64, 40, 24, torch.bfloat16, cuda)
    assert (tiny.block_n, tiny.block_k) == (64, 32)  # no wider than the padded matrix


@needs_triton
@pytest.mark.parametrize("num_tokens", [2, 17])
@pytest.mark.usefixtures("force_triton")
def test_fused_experts_dispatches_by_the_rule(num_tokens, monkeypatch):
    x, w13, w2, weights, ids = make_experts(num_tokens, 64, 32, 8, 2, torch.float32, seed=num_tokens)
    taken = []
    for name in ("gemv_experts", "grouped_experts"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *args, real=real, name=name: taken.append(name) or real(*args))
    out = moe.fused_experts(x, w13, w2, weights, ids)
    assert taken == [f"{moe.moe_path(num_tokens, 2, 8)}_experts"]
    torch.testing.assert_close(out, moe.fused_experts_ref(x, w13, w2, weights, ids), **tol(torch.float32))


def test_off_cuda_without_triton_everything_is_the_reference():
    x, w13, w2, weights, ids = make_experts(3, 16, 8, 4, 2, torch.float32, device="cpu")
    with switched(force_triton=False):
        assert torch.equal(moe.fused_experts(x, w13, w2, weights, ids), moe.fused_experts_ref(x, w13, w2, weights, ids))
        logits = torch.randn(3, 4)
        assert all(torch.equal(a, b) for a, b in zip(moe.route(logits, 2, True), moe.route_ref(logits, 2, True)))


@needs_triton
@pytest.mark.usefixtures("pdl_in_interpreter", "force_triton")
def test_pdl_path_in_the_interpreter():
    test_route_matches_the_reference(60, 2, True, torch.float32)
    test_align_blocks(17, 4, 64, 64, 4)
    for path in ("gemv", "grouped"):
        test_each_path_matches_the_reference(path, (3, 80, 48, 8, 2), torch.float32)


# -- CUDA: the real layer shape, CUDA graphs -------------------------------------------------------------------------
QWEN3_30B_A3B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_gpu_qwen3_30b_a3b_layer(path, num_tokens):
    x, w13, w2, weights, ids = make_experts(num_tokens, *QWEN3_30B_A3B.values(), torch.bfloat16, seed=num_tokens)
    out = (moe.gemv_experts if path == "gemv" else moe.grouped_experts)(x, w13, w2, weights, ids)
    want = moe.fused_experts_ref(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@needs_cuda
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 512])
def test_gpu_cuda_graph_replay_equals_eager(num_tokens, pdl):
    """route + fused_experts captured in one graph: a replay on new inputs is bit for bit the eager run on them."""
    x, w13, w2, _, _ = make_experts(num_tokens, *QWEN3_30B_A3B.values(), torch.bfloat16, seed=1)
    logits = torch.randn(num_tokens, 128, device=DEVICE)

    def step():
        weights, ids = moe.route(logits, 8, renormalize=True)
        return moe.fused_experts(x, w13, w2, weights, ids)

    with switched(pdl=pdl):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        torch.cuda.current_stream().wait_stream(stream)
        for seed in (2, 3):
            g = torch.Generator().manual_seed(seed)
            x.copy_(torch.randn(x.shape, generator=g))
            logits.copy_(torch.randn(logits.shape, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, step())


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize", [(1, 8, 2, True), (2, 60, 4, False),
                                                                         (3, 16, 3, True), (1, 128, 8, True)])
@pytest.mark.usefixtures("force_triton")
def test_routing_inside_the_gemv_kernels_equals_route_then_gemv(num_tokens, num_experts, top_k, renormalize):
    g = torch.Generator().manual_seed(num_experts)
    hidden, inter = 72, 40
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(DEVICE)
    logits[0, 1] = logits[0, 0]  # a tie: the lower expert wins in both
    want = moe.gemv_experts(x, w13, w2, *moe.route(logits, top_k, renormalize))
    torch.testing.assert_close(moe.routed_gemv_experts(x, logits, w13, w2, top_k, renormalize), want,
                               rtol=0, atol=0)
    torch.testing.assert_close(want, moe.fused_experts_ref(x, w13, w2, *moe.route_ref(logits, top_k, renormalize)),
                               rtol=1e-4, atol=1e-4)
    if moe.moe_path(num_tokens, top_k, num_experts) == moe.GEMV:
        assert torch.equal(moe.routed_experts(x, logits, w13, w2, top_k, renormalize), want)


@needs_triton
@pytest.mark.usefixtures("force_triton")
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy's, in the interpreter, on the NaN row
def test_nan_logits_route_to_experts_that_exist():
    """A row of NaN logits still names experts below E (the gemv kernels index the weights with them)."""
    logits = torch.randn(3, 60).to(DEVICE)
    logits[1] = float("nan")
    _, ids = moe.route(logits, 4, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 60
    x, w13, w2 = torch.randn(3, 64).to(DEVICE), torch.randn(60, 64, 64).to(DEVICE), torch.randn(60, 64, 32).to(DEVICE)
    out = moe.routed_gemv_experts(x, logits, w13, w2, 4, True)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, top_k, hidden", [(1, 8, 64), (5, 2, 100), (3, 4, 2048 + 32)])
@pytest.mark.usefixtures("force_triton")
def test_sum_pairs_adds_each_tokens_rows_in_fp32(num_tokens, top_k, hidden, dtype):
    """The grouped path's top-k sum: each token's k rows added in fp32 and rounded once (column tiles past H masked)."""
    pairs = torch.randn(num_tokens * top_k, hidden).to(DEVICE, dtype)
    want = pairs.float().view(num_tokens, top_k, hidden).sum(1).to(dtype)
    exact = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=0)  # one bf16 rounding
    torch.testing.assert_close(moe.sum_pairs(pairs, top_k), want, **exact)
