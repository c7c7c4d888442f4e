"""Plain-PyTorch paged attention: the CPU path and the oracle the Triton kernels (attention.py) are tested against.

Caches are [num_blocks, block_size, num_kv_heads, head_dim] (views: an fp8 cache's V is stored transposed within
its blocks); a token's slot is block_id * block_size + offset.

Two per-layer options, with transformers' semantics (masking_utils.sliding_window_overlay, Gemma 2's
attn_logit_softcapping): window W lets the query at position p see keys k with p - W < k <= p (at most W keys,
itself included; None: all of them); softcap c replaces the scaled logits s by c * tanh(s / c) before the mask and
the softmax (None: no capping).

An fp8 cache (kv_scales = (k_scale, v_scale): kernels/kv_quant.py) stores e4m3 codes, and per-token scales beside them;
reads dequantize what was stored. With its tail (kv_tail = (k_tail, v_tail), [rows, num_kv_heads, head_dim] in the
model's dtype: kv_quant.tail_row) the store also writes each token whose tail_rows entry is >= 0 there, and a query
reads the keys of its own block exact: the step's own k/v for the step's tokens, the tail rows for earlier ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels import kv_quant
from nanoserve.kernels.metadata import AttentionInputs
from nanoserve.kernels.paging import blocks_for


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None, tail_rows: torch.Tensor | None = None) -> None:
    """Write k/v [num_tokens, num_kv_heads, head_dim] into their cache slots (and, with a tail, into their tail rows)."""
    if kv_tail is not None:
        store_tail(k, v, kv_tail, tail_rows)
    slots = slot_mapping.long()
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]  # (by index: V may be stored transposed)
    for x, cache, scale in zip((k, v), (k_cache, v_cache), kv_scales or (None, None)):
        if scale is None:
            kv_quant.kernel_args(cache, None)  # a model-dtype cache
            value = x.to(cache.dtype)
        else:
            value, row_scale = kv_quant.quantize_ref(x, None if kv_quant.per_token(scale) else scale)
            if kv_quant.per_token(scale):
                scale[blocks, offsets] = row_scale.to(scale.dtype)
        if scale is not None:  # index_put_ has no fp8 kernel on CPU: copy the codes' bytes
            cache, value = cache.view(torch.uint8), value.view(torch.uint8)
        cache[blocks, offsets] = value


def store_tail(k: torch.Tensor, v: torch.Tensor, kv_tail: tuple[torch.Tensor, torch.Tensor],
               tail_rows: torch.Tensor) -> None:
    """k/v of the tokens whose tail row is >= 0 into the tail, in its dtype."""
    rows = tail_rows.long()
    keep = rows >= 0
    for x, tail in zip((k, v), kv_tail):
        tail.index_copy_(0, rows[keep], x[keep].to(tail.dtype))


def exact_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: the keys a query reads exact with a tail (those of its own block)."""
    return (q_pos[:, None] // block_size) == (k_pos[None, :] // block_size)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first context_len tokens of one sequence, [context_len, num_kv_heads, head_dim] (an fp8 cache's dequantized
    with its scale, in fp32)."""
    blocks = block_table[:blocks_for(context_len, cache.shape[1])].long()
    values = cache[blocks].flatten(0, 1)[:context_len]
    if scale is None:
        return values
    scale = scale[blocks].flatten(0, 1)[:context_len] if kv_quant.per_token(scale) else scale
    return kv_quant.dequantize_ref(values, scale)


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: which keys each query sees (causal, and within its window)."""
    mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The scaled logits squashed into (-softcap, softcap); unchanged without a softcap."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """softmax(mask(soft_cap(scale * q k^T))) v over [H, n, D] tensors; SDPA when there is nothing to cap."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = soft_cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionInputs, scale: float, *, window: int | None = None,
                      softcap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context (the last `window` keys of it).

    q: [num_new_tokens, num_heads, head_dim]; keys and values are read back from the cache (this step's are stored),
    so cached prefix blocks are covered; k/v (this step's) are read only with a tail, for each query's own block.
    Returns [num_new_tokens, num_heads, head_dim].
    """
    out = torch.zeros_like(q)  # rows of no sequence (graph padding) stay zero
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    query_lens = meta.query_lens_host or torch.diff(meta.cu_seqlens_q).tolist()
    context_lens = meta.context_lens_host or meta.context_lens.tolist()
    rows = meta.table_rows.tolist() if meta.table_rows is not None else range(len(query_lens))
    start = 0
    for q_len, ctx_len, row in zip(query_lens, context_lens, rows):
        if q_len == 0:
            continue
        qi = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
        ks, vs = kv_scales or (None, None)
        kv = [gather_context(c, meta.block_tables[row], ctx_len, s) for c, s in ((k_cache, ks), (v_cache, vs))]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        mask = visible_keys(q_pos, k_pos, window)
        if kv_tail is None:
            ki, vi = (x.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0).to(q.dtype) for x in kv)
            out[start:start + q_len] = _attend(qi, ki, vi, mask, scale, softcap).transpose(0, 1)
        else:
            exact = _exact_context(kv, (k[start:start + q_len], v[start:start + q_len]), kv_tail, row, ctx_len,
                                   k_cache.shape[1])
            near = exact_keys(q_pos, k_pos, k_cache.shape[1])
            out[start:start + q_len] = _attend_split(qi, kv, exact, near, mask, scale, softcap).transpose(0, 1)
        start += q_len
    return out


def _exact_context(far: list[torch.Tensor], fresh: tuple[torch.Tensor, torch.Tensor],
                   kv_tail: tuple[torch.Tensor, torch.Tensor], slot: int, ctx_len: int,
                   block_size: int) -> list[torch.Tensor]:
    """K and V [ctx_len, Hkv, D] fp32 as the keys of a query's own block are read: the step's own tokens (fresh, the
    last len(fresh) positions) and the tail rows of the earlier ones of the first query's block; the other
    positions are the dequantized cache's (never read exact)."""
    q_len = fresh[0].shape[0]
    first = (ctx_len - q_len) // block_size * block_size  # no query's block starts earlier
    pos = torch.arange(first, ctx_len - q_len, device=far[0].device)
    tail_rows = kv_quant.tail_row(slot, pos, block_size)
    out = []
    for x, new, tail in zip(far, fresh, kv_tail):
        x = x.clone()
        x[first:ctx_len - q_len] = tail[tail_rows].float()
        x[ctx_len - q_len:] = new.float()
        out.append(x)
    return out


def _attend_split(q: torch.Tensor, far: list[torch.Tensor], exact: list[torch.Tensor], near: torch.Tensor,
                  mask: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """q [H, n, D] over keys read exact where `near` ([n, L]) and from the fp8 cache elsewhere (far / exact: K and V
    [L, Hkv, D] fp32): fp32 scores selected per pair, one softmax, the two halves of the output summed in fp32."""
    group = q.shape[0] // far[0].shape[1]
    k_far, v_far, k_ex, v_ex = (x.transpose(0, 1).repeat_interleave(group, dim=0) for x in (*far, *exact))
    qf = q.float()
    scores = torch.where(near, qf @ k_ex.transpose(-1, -2), qf @ k_far.transpose(-1, -2))
    scores = soft_cap(scores * scale, softcap).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (torch.where(near, probs, 0.0) @ v_ex + torch.where(near, 0.0, probs) @ v_far).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, *, window: int | None = None,
                     softcap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None,
                     slots: torch.Tensor | None = None, seq_rows: int = 1,
                     group_back: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row over its paged context (its last `window` keys); fixed shapes, so it is
    graph-capturable. (seq_rows / group_back, how the Triton kernel groups a sequence's rows, change nothing here.)

    q: [num_seqs, num_heads, head_dim]; returns the same shape. Reads every block in block_tables
    (masked beyond context_lens): simple and correct, not fast. With a tail (slots: each row's), the keys of the
    query's own block come from the tail rows (the step's token was stored there first).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tables = block_tables.long()
    k, v = (_paged_rows(cache, tables, scale) for cache, scale in zip((k_cache, v_cache), kv_scales or (None, None)))
    positions = torch.arange(k.shape[1], device=q.device)
    if kv_tail is not None:
        bs = k_cache.shape[1]
        own = (positions[None, :] // bs == ((context_lens.long() - 1) // bs)[:, None])  # [S, L]
        rows = kv_quant.tail_row(slots.long()[:, None], positions[None, :], bs).clamp(max=kv_tail[0].shape[0] - 1)
        k, v = (torch.where(own[..., None, None], tail[rows].float(), x) for x, tail in zip((k, v), kv_tail))
    qg = q.to(torch.float32).view(num_seqs, num_kv_heads, group, head_dim)
    scores = soft_cap(torch.einsum("skgd,slkd->skgl", qg, k) * scale, softcap)
    valid = visible_keys(context_lens.long() - 1, positions, window)  # [S, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    v = torch.where(valid[:, :, None, None], v, 0.0)  # unwritten slots may hold anything, NaN included
    out = torch.einsum("skgl,slkd->skgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _paged_rows(cache: torch.Tensor, tables: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Every slot the block tables name, [S, L, Hkv, D] fp32 (dequantized for an fp8 cache)."""
    rows = cache[tables].flatten(1, 2)
    if scale is None:
        return rows.to(torch.float32)
    return kv_quant.dequantize_ref(rows, scale[tables].flatten(1, 2) if kv_quant.per_token(scale) else scale)
