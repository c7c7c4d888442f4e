"""Mixture-of-experts kernels: the router's top-k and the experts' SwiGLU MLPs summed over each token's top-k
(Triton on CUDA, plain PyTorch elsewhere; the `_ref` functions are the oracles the tests check the kernels against).

Weights, the model's layout: w13 [E, 2I, H] (per expert the gate rows 0..I-1, then the up rows I..2I-1; y = x @ w.T
like nn.Linear) and w2 [E, H, I]. Token t's output is sum_j weight[t, j] * w2[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t])
with e = ids[t, j]. Routing weights are fp32 and expert ids int32 throughout; inter (the SwiGLU output) is stored in
the activations' dtype, like the dense MLP's.

route: softmax over all experts in fp32, top-k, optional renormalization: one kernel, one program per token.

routed_experts (the model's call: router logits in) and fused_experts (routing given) take one of two paths, chosen
by moe_path from shapes only (a CUDA graph of a batch size holds one):
  * "gemv" (decode, a few tokens): only the selected experts' weights are read, nothing is sorted. Two launches, each
    program reading a row tile of all k experts of its token at once (k loads in flight) and, from router logits,
    computing the token's top-k itself (no route launch): the gate and up products with SiLU·mul → inter [T*k, I];
    then the down products of its k experts, weighted and summed in order (deterministic, no atomics) → out [T, H].
  * "grouped" (prefill, many tokens): route, then align_blocks sorts the pairs by expert into blocks of BLOCK_M rows
    (one launch), then a grouped GEMM per projection (moe_gemm.py): gate/up with SiLU·mul fused → inter, down with the
    routing weight fused → out_pairs [T*k, H], then each token's k rows summed in a fixed order (sum_pairs: fp32,
    one launch; torch's reduce took 2× as long). Five launches (four at k = 1).
Everything is CUDA-graph capturable: no host syncs, every size comes from shapes (align_blocks pads to a bound),
and a program past the real work exits at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels._triton import cdiv, jit, next_power_of_2, num_sms, pdl_args, pdl_start, pdl_wait, tl, use_triton
from nanoserve.kernels.moe_gemm import grouped_gemm, grouped_tiles

GEMV, GROUPED = "gemv", "grouped"
GEMV_MAX_TOKENS = 2  # up to this many tokens the gemv path always runs
# ...and while the pairs are at most a share of the experts (most experts then have no pair, so reading just the
# selected ones beats sorting), clamped to a number of pairs past which the tensor cores win whatever E is. Measured
# (benchmarks/moe_tiles.py): at 8 tokens of Qwen3-30B-A3B (64 pairs, ~50 experts) the gemv path reads 64 experts'
# weights in 200 µs a layer while the grouped one reads each of 126 experts once, for 64 tokens, in 282 µs.
GEMV_MAX_PAIRS_PER_EXPERT = 0.25
GEMV_MAX_PAIRS = 256
# gemv tiles (benchmarks/moe_tiles.py at both real shapes): rows narrowed until the grid has a program per SM, then K
# tiles as wide as a thread's fp32 accumulators allow without spilling (128 a thread: 256 spill, 10-40x slower).
# Mixtral's 14336-wide experts went 215 -> ~173 us a layer over the old 4096-element tiles; Qwen3's stayed at ~31.
GEMV_PROGRAMS_PER_SM = 1
GEMV_ACC_PER_THREAD = 128
GEMV_BLOCK_K = 1024  # the widest K tile of a gemv weight row on CUDA
GEMV_NUM_WARPS = 4
ALIGN_CHUNK = 1024  # expert ids per step of align_blocks' scans


def moe_path(num_tokens: int, top_k: int, num_experts: int) -> str:
    """Which device path fused_experts runs: the one place that rule lives."""
    pairs = num_tokens * top_k
    if num_tokens <= GEMV_MAX_TOKENS or pairs <= min(int(num_experts * GEMV_MAX_PAIRS_PER_EXPERT), GEMV_MAX_PAIRS):
        return GEMV
    return GROUPED


# -- routing -----------------------------------------------------------------------------------------------------
def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax, the k largest (a stable sort: ties go to the lower expert, as in the kernel), renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights fp32 [T, k], expert ids int32 [T, k]), largest first, ties to the lower id."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    if not use_triton(logits):
        return route_ref(logits, top_k, renormalize)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                     BLOCK_E=next_power_of_2(num_experts), BLOCK_K=next_power_of_2(top_k),
                                     RENORMALIZE=renormalize, **pdl_args(logits.device))
    return weights, ids


@jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_row, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    top_w, top_id = _top_k(logits_ptr + row * stride_row, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_id, mask=slots < TOP_K)


# -- the experts: dispatch and the oracle ------------------------------------------------------------------------
def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """Loop over the experts present (like HF's Qwen3MoeExperts.forward), fp32 products and sums, inter rounded to
    x.dtype like the kernels store it; the result cast to x.dtype."""
    num_tokens, top_k = topk_ids.shape
    inter_size = w13.shape[1] // 2
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat, weights = topk_ids.flatten().long(), topk_weights.flatten().float()
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        gate_up = x[tokens].float() @ w13[e].float().T
        inter = (F.silu(gate_up[:, :inter_size]) * gate_up[:, inter_size:]).to(x.dtype).float()
        out.index_add_(0, tokens, (inter @ w2[e].float().T) * weights[pairs, None])
    return out.to(x.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE block's experts: x [T, H] → [T, H] in x.dtype, on the path moe_path picks (module docstring)."""
    if not use_triton(x):
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)
    path = moe_path(x.shape[0], topk_ids.shape[1], w13.shape[0])
    return (gemv_experts if path == GEMV else grouped_experts)(x, w13, w2, topk_weights, topk_ids)


def routed_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                   renormalize: bool) -> torch.Tensor:
    """The MoE block from its router logits [T, E]: routing and the experts, on the path moe_path picks (the gemv path
    routes inside its two kernels; the grouped one launches route first)."""
    if use_triton(x) and moe_path(x.shape[0], top_k, w13.shape[0]) == GEMV:
        return routed_gemv_experts(x, logits, w13, w2, top_k, renormalize)
    return fused_experts(x, w13, w2, *route(logits, top_k, renormalize))


def _checked(x, w13, w2, topk_weights, topk_ids):
    """(T, H, I, E, k, weights, ids) after the layout checks; weights fp32 and ids int32, both contiguous."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    if w13.shape[2] != hidden or two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2) \
            or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"MoE shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want [E, 2I, H]), w2 "
                         f"{tuple(w2.shape)} (want [E, H, I]), weights {tuple(topk_weights.shape)}, ids "
                         f"{tuple(topk_ids.shape)} (want [T, k])")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 need a contiguous last dimension")
    return (num_tokens, hidden, two_i // 2, num_experts, topk_ids.shape[1],
            topk_weights.float().contiguous(), topk_ids.to(torch.int32).contiguous())


# -- the gemv path -------------------------------------------------------------------------------------------------
def _gemv_tiles(programs: int, n: int, top_k: int, device: torch.device, gated: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a gemv kernel whose programs each read BLOCK_N rows of all k experts of a
    token (gated: and as many up rows, a second accumulator): rows as many as keep GEMV_PROGRAMS_PER_SM programs per
    SM (a narrow tile per expert, but k of them in flight at once), then K tiles that fill GEMV_ACC_PER_THREAD."""
    if device.type != "cuda":
        return 4, 32, 4
    want = GEMV_PROGRAMS_PER_SM * num_sms(device)
    block_n = next((b for b in (16, 8, 4) if programs * cdiv(n, b) >= want), 2)
    accumulators = (2 if gated else 1) * next_power_of_2(top_k) * block_n
    block_k = GEMV_ACC_PER_THREAD * 32 * GEMV_NUM_WARPS // accumulators
    return block_n, max(32, min(GEMV_BLOCK_K, block_k)), GEMV_NUM_WARPS


def gemv_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_experts' decode path (module docstring), whatever moe_path says; the tests force it."""
    if not use_triton(x):
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden, inter_size, num_experts, top_k, weights, ids = _checked(x, w13, w2, topk_weights, topk_ids)
    return _gemv(x, w13, w2, (ids, weights), None, num_experts, top_k, False)


def routed_gemv_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                        renormalize: bool) -> torch.Tensor:
    """route + the gemv path in two launches: each program of both kernels computes its token's top-k from the router
    logits itself (k rounds of argmax over E values: cheaper than a launch of its own, which decode pays in latency)."""
    num_experts = w13.shape[0]
    if not use_triton(x):
        return fused_experts_ref(x, w13, w2, *route_ref(logits, top_k, renormalize))
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    return _gemv(x, w13, w2, None, (logits, renormalize), num_experts, top_k, True)


def _gemv(x, w13, w2, routed, logits, num_experts: int, top_k: int, route: bool) -> torch.Tensor:
    num_tokens, hidden = x.shape
    inter_size = w2.shape[2]
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    ids, weights = routed if routed is not None else (x, x)  # placeholders, never read when routing in the kernel
    logit_rows, renormalize = logits if logits is not None else (x, False)
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=x.dtype, device=x.device)
    shared = dict(TOP_K=top_k, KP=next_power_of_2(top_k), EP=next_power_of_2(num_experts), ROUTE=route,
                  RENORMALIZE=renormalize, **pdl_args(x.device))
    block_n, block_k, warps = _gemv_tiles(num_tokens, inter_size, top_k, x.device, gated=True)
    _gemv_gate_up_kernel[(num_tokens, cdiv(inter_size, block_n))](
        x, logit_rows, ids, w13, inter, hidden, inter_size, num_experts, x.stride(0), logit_rows.stride(0),
        w13.stride(0), w13.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        num_warps=warps, **shared)
    block_n, block_k, warps = _gemv_tiles(num_tokens, hidden, top_k, x.device, gated=False)
    _gemv_down_kernel[(num_tokens, cdiv(hidden, block_n))](
        inter, logit_rows, ids, weights, w2, out, hidden, inter_size, num_experts, logit_rows.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=inter_size % block_k == 0, num_warps=warps, **shared)
    return out


@jit
def _top_k(logits_ptr, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
           RENORMALIZE: tl.constexpr):
    """One token's (weights fp32 [BLOCK_K], ids int32 [BLOCK_K]) from its router logits: fp32 softmax, k rounds of
    argmax (the lowest index among equals), optionally renormalized; slots past TOP_K hold weight 0, id 0."""
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + experts, mask=experts < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    left = tl.where(experts < num_experts, p / tl.sum(p, axis=0), -1.0)  # the padding is never chosen
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        # NaN logits (a graph's warm-up on unset buffers, a diverged model) match nothing: an id past the experts
        # would send the gemv kernels' loads out of the weights, so it is clamped to the last expert
        idx = tl.minimum(tl.min(tl.where(left == best, experts, BLOCK_E), axis=0), num_experts - 1)
        top_w = tl.where(slots == j, best, top_w)
        top_id = tl.where(slots == j, idx, top_id)
        left = tl.where(experts == idx, -1.0, left)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_id


@jit
def _token_routing(logits_ptr, ids_ptr, weights_ptr, token, num_experts, stride_l, TOP_K: tl.constexpr,
                   KP: tl.constexpr, EP: tl.constexpr, ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr):
    """(weights [KP], ids [KP] int64) of a token: computed from its logits (ROUTE) or read from route's output."""
    slots = tl.arange(0, KP)
    if ROUTE:
        weights, ids = _top_k(logits_ptr + token * stride_l, num_experts, TOP_K, EP, KP, RENORMALIZE)
    else:
        ids = tl.load(ids_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0)
        weights = tl.load(weights_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0.0)
    return weights, ids.to(tl.int64)


@jit
def _gemv_gate_up_kernel(x_ptr, logits_ptr, ids_ptr, w_ptr, inter_ptr, H, I, num_experts, stride_x, stride_l,
                         stride_we, stride_wn, TOP_K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                         ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (t, n): inter[t*k + j, n-tile] = silu(gate rows · x) * (up rows · x) of expert ids[t, j], every j at
    once (k experts' loads in flight together)."""
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)  # the router's logits (or ids) and x are the previous kernels'
    token = tl.program_id(0).to(tl.int64)
    _, ids = _token_routing(logits_ptr, ids_ptr, ids_ptr, token, num_experts, stride_l, TOP_K, KP, EP, ROUTE,
                            RENORMALIZE)
    slots = tl.arange(0, KP)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = (w_ptr + ids[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn
                 + cols[None, None, :])
    up_step = I * stride_wn
    mask = (slots[:, None, None] < TOP_K) & (rows[None, :, None] < I)
    x_row = x_ptr + token * stride_x
    acc_gate = tl.zeros([KP, BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K once, after the loop
    acc_up = tl.zeros([KP, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if EVEN_K:
            xk = tl.load(x_row + k + cols).to(tl.float32)
            w_mask = mask
        else:
            xk = tl.load(x_row + k + cols, mask=k + cols < H, other=0.0).to(tl.float32)
            w_mask = mask & (k + cols[None, None, :] < H)
        acc_gate += tl.load(gate_ptrs + k, mask=w_mask, other=0.0).to(tl.float32) * xk[None, None, :]
        acc_up += tl.load(gate_ptrs + up_step + k, mask=w_mask, other=0.0).to(tl.float32) * xk[None, None, :]
    gate = tl.sum(acc_gate, axis=2)
    inter = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_up, axis=2)
    out_ptrs = inter_ptr + (token * TOP_K + slots)[:, None] * I + rows[None, :]
    tl.store(out_ptrs, inter.to(inter_ptr.dtype.element_ty), mask=(slots[:, None] < TOP_K) & (rows[None, :] < I))


@jit
def _gemv_down_kernel(inter_ptr, logits_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, H, I, num_experts, stride_l,
                      stride_we, stride_wn, stride_out, TOP_K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (t, n): out[t, n-tile] = Σ_j weight[t, j] · w2[ids[t, j]] rows · inter[t*k + j], the k experts' loads
    in flight together and summed in a fixed order (deterministic, no atomics)."""
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    weights, ids = _token_routing(logits_ptr, ids_ptr, weights_ptr, token, num_experts, stride_l, TOP_K, KP, EP, ROUTE,
                                  RENORMALIZE)
    slots = tl.arange(0, KP)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + ids[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn
              + cols[None, None, :])
    mask = (slots[:, None, None] < TOP_K) & (rows[None, :, None] < H)
    v_ptrs = inter_ptr + (token * TOP_K + slots)[:, None] * I + cols[None, :]
    acc = tl.zeros([KP, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        if EVEN_K:
            v = tl.load(v_ptrs + k, mask=slots[:, None] < TOP_K, other=0.0).to(tl.float32)
            w_mask = mask
        else:
            v = tl.load(v_ptrs + k, mask=(slots[:, None] < TOP_K) & (k + cols[None, :] < I), other=0.0).to(tl.float32)
            w_mask = mask & (k + cols[None, None, :] < I)
        acc += tl.load(w_ptrs + k, mask=w_mask, other=0.0).to(tl.float32) * v[:, None, :]
    out = tl.sum(tl.sum(acc, axis=2) * weights[:, None], axis=0)
    tl.store(out_ptr + token * stride_out + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)


# -- the grouped path: align_blocks, then moe_gemm -----------------------------------------------------------------
def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_padded, max_blocks): the most slots align_blocks can fill, each expert present padding its pairs to a
    multiple of block_m (at most min(pairs, E) experts are present), as a multiple of block_m."""
    max_padded = cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m) * block_m
    return max_padded, max_padded // block_m


def align_blocks_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """align_blocks in plain PyTorch (host syncs and all: the oracle, and the path off CUDA)."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    max_padded, max_blocks = align_sizes(num_pairs, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)  # the pairs by expert, in pair order within one
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(torch.cumsum(padded, 0) - padded)[expert_of] + rank] = order.to(torch.int32)
    experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=flat.device)
    block_expert[:experts.numel()] = experts.to(torch.int32)
    return sorted_pairs, block_expert, padded.sum().reshape(1).to(torch.int32)


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pairs (flat indices t*k + j of topk_ids) grouped by expert into blocks of block_m (a power of two), for the
    grouped GEMM: (sorted_pairs int32 [max_padded], block_expert int32 [max_blocks], num_padded int32 [1]); see
    align_sizes. Each expert's pairs are contiguous, in pair order, padded with the sentinel T*k to a multiple of
    block_m; the blocks of an expert are contiguous and experts come in id order; slots past num_padded hold the
    sentinel and blocks past it -1. On the device in one launch, fixed sizes, no host sync (CUDA graphs)."""
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if not use_triton(topk_ids):
        return align_blocks_ref(topk_ids, num_experts, block_m)
    ids = topk_ids.to(torch.int32).contiguous()
    num_pairs, device = ids.numel(), ids.device
    max_padded, max_blocks = align_sizes(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(num_experts,)](ids, sorted_pairs, block_expert, num_padded, num_pairs, num_experts,
                                  max_padded, max_blocks, BLOCK_M=block_m, BLOCK_E=next_power_of_2(num_experts),
                                  CHUNK=ALIGN_CHUNK, **pdl_args(device))
    return sorted_pairs, block_expert, num_padded


@jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, max_padded,
                  max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """Program e: counts every expert's pairs (a histogram of all ids: each program scans them, as a separate count
    kernel's programs would, and a launch fewer waits on the router), so its expert's slots start after the padded
    counts of the experts below it; it writes its pairs there in pair order (a running total plus the chunk's
    cumulative sum), then its padding and its blocks, and a share of the tail past the total (sentinel slots, -1
    blocks); program 0 writes the total."""
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for chunk in range(0, num_pairs, CHUNK):  # the tail past num_pairs reads as expert 0, taken off below
        counts += tl.histogram(tl.load(ids_ptr + chunk + offs, mask=chunk + offs < num_pairs, other=0), BLOCK_E)
    counts -= tl.where(experts == 0, tl.cdiv(num_pairs, CHUNK) * CHUNK - num_pairs, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    total = tl.sum(padded, axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    end = start + tl.sum(tl.where(experts == expert, padded, 0), axis=0)
    offs = tl.arange(0, CHUNK)
    sentinel = tl.zeros([CHUNK], dtype=tl.int32) + num_pairs
    pos = start
    for chunk in range(0, num_pairs, CHUNK):
        pairs = chunk + offs
        hit = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) == expert
        tl.store(sorted_ptr + pos + tl.cumsum(hit.to(tl.int32), axis=0) - 1, pairs, mask=hit)
        pos += tl.sum(hit.to(tl.int32), axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pad, tl.zeros([BLOCK_M], dtype=tl.int32) + num_pairs, mask=pad < end)
    for block in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        tl.store(block_expert_ptr + block + offs, tl.zeros([CHUNK], dtype=tl.int32) + expert,
                 mask=block + offs < end // BLOCK_M)
    for slot in range(total + expert * CHUNK, max_padded, num_experts * CHUNK):
        tl.store(sorted_ptr + slot + offs, sentinel, mask=slot + offs < max_padded)
    for block in range(total // BLOCK_M + expert * CHUNK, max_blocks, num_experts * CHUNK):
        tl.store(block_expert_ptr + block + offs, sentinel * 0 - 1, mask=block + offs < max_blocks)
    if expert == 0:
        tl.store(num_padded_ptr, total)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_experts' prefill path (module docstring), whatever moe_path says; the tests force it."""
    if not use_triton(x):
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden, inter_size, num_experts, top_k, weights, ids = _checked(x, w13, w2, topk_weights, topk_ids)
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    num_pairs = num_tokens * top_k
    tiles_up = grouped_tiles(num_pairs / num_experts, inter_size, hidden, x.dtype, x.device)
    tiles_down = grouped_tiles(num_pairs / num_experts, hidden, inter_size, x.dtype, x.device)
    aligned = align_blocks(ids, num_experts, tiles_up.block_m)
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, inter, *aligned, weights, top_k, gated=True, tiles=tiles_up)
    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(inter, w2, out_pairs, *aligned, weights, top_k, gated=False, tiles=tiles_down)
    return out_pairs if top_k == 1 else sum_pairs(out_pairs, top_k)


SUM_PAIRS_BLOCK = 1024  # columns a sum_pairs program adds


def sum_pairs(out_pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """out_pairs [T*k, H] (token t's k rows together) → [T, H]: each token's rows added in order in fp32, rounded
    once (deterministic: no atomics, so replay equals eager bit for bit)."""
    num_pairs, hidden = out_pairs.shape
    if not use_triton(out_pairs):
        return out_pairs.view(num_pairs // top_k, top_k, hidden).float().sum(1).to(out_pairs.dtype)
    out = torch.empty(num_pairs // top_k, hidden, dtype=out_pairs.dtype, device=out_pairs.device)
    block = min(SUM_PAIRS_BLOCK, next_power_of_2(hidden))
    _sum_pairs_kernel[(num_pairs // top_k, cdiv(hidden, block))](out_pairs, out, hidden, TOP_K=top_k, BLOCK=block,
                                                                 num_warps=4, **pdl_args(out.device))
    return out


@jit
def _sum_pairs_kernel(src_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (token * TOP_K + j) * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)
