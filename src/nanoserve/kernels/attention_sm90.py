"""The fp8 decode attention on Hopper, in Gluon: warps that work independently, FlashDecoding-style.

Each warp multiplies its own 32 keys of every tile with fp16 `mma.sync m16n8k16`, the e4m3 codes widened to fp16 in
registers (exact) as ldmatrix delivers them (fp8 `mma.sync` has no Hopper instruction: ptxas emulates it with the
same fp16 products plus conversions of both operands every time, q's included, ~19% more instructions a tile); the
GQA group's heads are M's rows 0-7 (q divided by a power of 2 into fp16's range: exact), 8-15 padding. Each warp
keeps its own running max, sum and output, and the warps merge once, at the end of the partition: a tile costs two
CTA barriers, where reductions across warps (the Triton kernels' tensor-core path, a wgmma over keys) cost ten. The
probabilities, times each value's scale over the warp's largest, reach the second product in fp16 by in-warp
shuffles. K [block, kv_heads, d] and V transposed within its block ([kv_heads, d, block]: the 8-bit loads' K-major
order) stream through a ring of shared-memory stages by cp.async, with the (K, V) scale pairs (runner/kv_cache.py
lays the cache out so). The query's own block is read exact from the cache's bf16 tail (kernels/kv_quant.py) by one
split, as in attention.py's kernels, with bf16 `mma.sync`. The partitions and partials are attention.py's
(kernels/decode_split.py), merged by its reduce.

Measured on an H100 (notes/PERF.md round 8, ninth to twelfth sessions): in the engine's step, with the tail and
one-warp programs, ~0.87 of the copy bandwidth at Qwen3-0.6B b = 256 (103 µs a layer; two-warp programs 112, the
Triton fp8 kernel 156) and ~0.95 at Llama-3.1-8B b = 16 over 32k tokens.
"""
from __future__ import annotations

import functools

import torch

from nanoserve.kernels import kv_quant
from nanoserve.kernels.decode_split import decode_partition, tail_split

from nanoserve.kernels._triton import _MissingKernel

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    # Gluon is experimental and its API moves: the kernel is written against Triton 3.6's (later versions renamed
    # cp.async's copy and the CTA barrier); with another, the Triton kernels decode.
    if not (hasattr(cp, "async_copy_global_to_shared") and hasattr(gl, "thread_barrier")):
        raise ImportError("another Gluon API")
    _jit = gluon.jit
except ImportError:  # no Triton, or one without this Gluon: the Triton kernels decode
    gluon = gl = cp = mma_v2 = None
    _jit = _MissingKernel

WARPS = 1  # a program's warps: 8 one-warp programs an SM by registers, against 4 of 2 warps (−9% at Qwen3 b = 256,
# −7% at b = 64, +3% at 32k on an H100: notes/PERF.md, round 8, twelfth session)
STAGES = 2  # the ring's depth
WARP_KEYS = 32  # keys a warp multiplies per tile (the second product: two k16 steps of mma.sync m16n8k16)
BLOCK_N = WARPS * WARP_KEYS  # keys a tile: the partitions' unit
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
MAX_GROUP = 8  # query heads a kv head: rows 0-7 of the mma's M


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None, window: int | None, softcap: float | None,
             seq_rows: int, kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether this kernel decodes the call: a Hopper GPU with Gluon, bf16 queries over an fp8 cache with its bf16 tail
    and per-token scales in (K, V) pairs, V transposed within its blocks (KVCacheSpec's layout), no window or
    softcap, one row a sequence. With the tail every fp8 partition ends on a block boundary, so the whole blocks V
    is copied in (16 bytes a copy) hold only the context's keys."""
    if gluon is None or not q.is_cuda or kv_scales is None or window is not None or softcap is not None:
        return False
    if kv_tail is None or kv_tail[0].dtype != torch.bfloat16 or kv_tail[0].stride(-1) != 1:
        return False  # (without the tail a partition's last block may hold stale codes: V's copies are whole blocks)
    k_scale, v_scale = kv_scales
    _, block_size, kv_heads, head_dim = k_cache.shape
    return (seq_rows == 1 and _hopper(q.device.index or 0) and kv_quant.per_token(k_scale)
            and k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 2
            and v_scale.data_ptr() == k_scale.data_ptr() + k_scale.element_size()
            and k_cache.stride(-1) == 1 and v_cache.stride(1) == 1 and v_cache.stride(3) == block_size
            and head_dim in HEAD_DIMS and block_size in BLOCK_SIZES and q.shape[1] // kv_heads <= MAX_GROUP
            and q.dtype == torch.bfloat16)


def decode(q, k_cache, v_cache, block_tables, context_lens, qk_scale: float, kv_scales, num_splits: int,
           out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, kv_tail=None, slots=None) -> None:
    """Launch over (kv heads, sequences, splits): the output when num_splits is 1, else the partials (attention.
    decode_attention's; partitions of BLOCK_N keys). qk_scale: the log2-domain score scale. kv_tail / slots: the
    tail and each row's slot (its own block's keys exact), or None."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    vb, vt, vh, vd = v_cache.stride()
    tail = kv_tail is not None
    k_tail, v_tail = kv_tail if tail else (q, q)
    head_dim_threads = head_dim // 16
    _decode_kernel[(kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, kv_scales[0], block_tables, context_lens, out, part_acc, part_ml, k_tail, v_tail,
        slots if tail else context_lens, qk_scale, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], vb, vh, vd, block_tables.stride(0), *kv_scales[0].stride(),
        k_tail.stride(0) if tail else 0, k_tail.stride(1) if tail else 0,
        BLOCK_SIZE=block_size, GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, SPLIT=num_splits > 1, STAGES=STAGES,
        TAIL=tail, K_SMEM=gl.SwizzledSharedLayout(16, 1, min(8, head_dim_threads), [2, 1, 0]),
        V_SMEM=gl.SwizzledSharedLayout(16, 4, 2, [2, 1, 0]), S_SMEM=gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]),
        S_READ=_scale_read_layout(WARPS), num_warps=WARPS)


def _scale_read_layout(num_warps: int):
    """[W, 32, 2] (each key's K and V scale) in registers as the scores' halves hold a key's column (a thread: keys
    2 (l % 4) + {0, 1} + 8 i of its warp's 32, the pair innermost): split, the scores' per-key layout with no data
    movement (the kernel asserts the conversion trivial)."""
    warps = [[1 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout([[0, 0, 1], [0, 1, 0], [0, 8, 0], [0, 16, 0]],
                                      [[0, 2, 0], [0, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], warps, [],
                                      [num_warps, 32, 2])


@_jit
def _program_keys(lens_ptr, window, num_splits, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                  TAIL: gl.constexpr):
    """(kv head, sequence, split, whether it runs, first fp8 key, end of its fp8 keys, whether it reads the own
    block exact, its first key, the context length) of this program of a (kv heads, sequences, splits) grid, by
    decode_split's rules."""
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    split = gl.program_id(2)
    context_len = gl.load(lens_ptr + seq)
    _, first_tile, partition, split_end = decode_partition(context_len, window, num_splits, BLOCK_N, BLOCK_SIZE, TAIL)
    part_start = first_tile + split * partition
    part_end = gl.minimum(part_start + partition, split_end)
    if TAIL:
        own_split, _ = tail_split(first_tile, partition, split_end, num_splits)
        is_own = split == own_split
        runs = is_own | (part_start < split_end)
    else:  # "<=": an empty context writes zeros from split 0 (the reduce ignores the empty partials)
        is_own = split < 0
        runs = part_start <= context_len
    return kv_head, seq, split, runs, part_start, gl.maximum(part_end, part_start), is_own, split_end, context_len


@_jit
def _warp_keys(start, W: gl.constexpr, LAYOUT: gl.constexpr):
    """[W, 32]: warp w's keys of the tile at `start` (start + 32 w + j) in LAYOUT."""
    return start + gl.arange(0, W, gl.SliceLayout(1, LAYOUT))[:, None] * 32 + \
        gl.arange(0, 32, gl.SliceLayout(0, LAYOUT))[None, :]


@_jit
def _warp_blocks(table, start, end, BLOCK_SIZE: gl.constexpr, W: gl.constexpr, KC: gl.constexpr, VC: gl.constexpr,
                 SC: gl.constexpr):
    """The block ids of the tile at `start` ([W, 32], 0 past `end`) as the K, V and scale copies each hold them: loads
    (L1 hits) a tile ahead instead of two layout conversions through shared memory on the way."""
    return (_block_ids(table, start, end, BLOCK_SIZE, W, gl.SliceLayout(2, KC)),
            _block_ids(table, start, end, BLOCK_SIZE, W, gl.SliceLayout(1, VC)),
            _block_ids(table, start, end, BLOCK_SIZE, W, gl.SliceLayout(2, SC)))


@_jit
def _block_ids(table, start, end, BLOCK_SIZE: gl.constexpr, W: gl.constexpr, LAYOUT: gl.constexpr):
    """[W, 32] in LAYOUT: each key's block id, loaded once a warp and block (a warp's 32 keys are one 32-token block or
    two 16-token ones: tiles start on block boundaries), so every address of a block shares one product."""
    w = gl.arange(0, W, gl.SliceLayout(1, LAYOUT))
    j = gl.arange(0, 32, gl.SliceLayout(0, LAYOUT))
    first = start // BLOCK_SIZE + w * (32 // BLOCK_SIZE)
    ids = gl.load(table + first, mask=first * BLOCK_SIZE < end, other=0)[:, None] + j[None, :] * 0
    if BLOCK_SIZE < 32:
        second = gl.load(table + first + 1, mask=(first + 1) * BLOCK_SIZE < end, other=0)
        ids = gl.where(j[None, :] < BLOCK_SIZE, ids, second[:, None])
    return ids


@_jit
def _in_block(BLOCK_SIZE: gl.constexpr, W: gl.constexpr, LAYOUT: gl.constexpr):
    """[W, 32] in LAYOUT: each key's offset in its block, constants (a tile starts on a block boundary)."""
    return _warp_keys(0, W, LAYOUT) % BLOCK_SIZE


@_jit
def _issue(k_tile, v_tile, s_tile, k_ptr, v_ptr, s_ptr, k_blocks, v_blocks, s_blocks, start, end, kv_head,
           stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, stride_sb, stride_st, stride_sh,
           BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, W: gl.constexpr, KC: gl.constexpr, VC: gl.constexpr,
           SC: gl.constexpr):
    """cp.async of keys [start, start + W · 32) into one stage, each warp its own 32 keys: K [W, 32, head_dim] (16
    bytes along head_dim), V^T [W, head_dim, 32] (a block's 16 keys of one dim) and the (K, V) scale pairs [W, 32, 2]
    (4 bytes a key); keys at or past `end` zero-filled (their probabilities are 0, and 0 · NaN would not be)."""
    keys = _warp_keys(start, W, gl.SliceLayout(2, KC))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(1, KC)))
    k_at = (k_blocks.to(gl.int64) * stride_kb + _in_block(BLOCK_SIZE, W, gl.SliceLayout(2, KC)) * stride_kt
            + kv_head * stride_kh)[:, :, None]
    cp.async_copy_global_to_shared(k_tile, k_ptr + k_at + dims[None, None, :], mask=(keys < end)[:, :, None])
    vkeys = _warp_keys(start, W, gl.SliceLayout(1, VC))
    v_dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(2, VC)))
    v_at = (v_blocks.to(gl.int64) * stride_vb + kv_head * stride_vh
            + _in_block(BLOCK_SIZE, W, gl.SliceLayout(1, VC)))[:, None, :] + (v_dims * stride_vd)[None, :, None]
    v_at = gl.max_contiguous(gl.multiple_of(v_at, [1, 1, 16]), [1, 1, 16])
    v_ok = gl.max_constancy((vkeys // BLOCK_SIZE * BLOCK_SIZE < end)[:, None, :], [1, 1, 16])
    cp.async_copy_global_to_shared(v_tile, v_ptr + v_at, mask=v_ok)
    skeys = _warp_keys(start, W, gl.SliceLayout(2, SC))
    s_at = (s_blocks.to(gl.int64) * stride_sb + _in_block(BLOCK_SIZE, W, gl.SliceLayout(2, SC)) * stride_st
            + kv_head * stride_sh)
    s_at = s_at[:, :, None] + gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, SC)))[None, None, :]
    s_at = gl.max_contiguous(gl.multiple_of(s_at, [1, 1, 2]), [1, 1, 2])
    cp.async_copy_global_to_shared(s_tile, s_ptr + s_at, mask=(skeys < end)[:, :, None])


@_jit
def _row_halves(x):
    """[W, 16, C] → rows 0-7 and rows 8-15, each [W, 8, C] (a thread holds row r and r + 8 of an m16n8 tile)."""
    W: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[2]
    return gl.split(gl.permute(gl.reshape(x, [W, 2, 8, C]), (0, 2, 3, 1)))


@_jit
def _stack_rows(a, b):
    """[W, 8, C] twice → [W, 16, C]: a in rows 0-7, b in rows 8-15 (_row_halves' inverse)."""
    W: gl.constexpr = a.shape[0]
    C: gl.constexpr = a.shape[2]
    return gl.reshape(gl.permute(gl.join(a, b), (0, 3, 1, 2)), [W, 16, C])


@_jit
def _load_q(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, W: gl.constexpr,
            QL: gl.constexpr, QA: gl.constexpr):
    """The group's query rows in fp16 as mma.sync's A operand [W, 16, head_dim] (every warp the same, rows past the
    group zero), divided by a power of 2 that keeps them within fp16's range (exact: bf16's mantissa fits), and that
    divisor [W, 8]."""
    rows = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(1, QL)))
    warps = gl.arange(0, W, gl.SliceLayout(1, gl.SliceLayout(2, QL)))
    at = seq * stride_qb + (kv_head * GROUP + rows)[None, :, None] * stride_qh + dims[None, None, :] + \
        warps[:, None, None] * 0
    q = gl.load(q_ptr + at, mask=(rows < GROUP)[None, :, None] & (warps >= 0)[:, None, None], other=0.0)
    q = q.to(gl.float32)
    amax = gl.max(gl.abs(q), 2)
    scale = gl.exp2(gl.maximum(gl.ceil(gl.log2(gl.maximum(amax, 1.0) * (1.0 / 16384.0))), 0.0))
    q16 = (q / scale[:, :, None]).to(gl.float16)
    return gl.convert_layout(_stack_rows(q16, gl.zeros_like(q16)), QA), scale


@_jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, s_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, k_tail_ptr,
                   v_tail_ptr, slots_ptr, qk_scale, num_splits, stride_qb, stride_qh, stride_ob, stride_oh, stride_kb,
                   stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, stride_bt, stride_sb, stride_st, stride_sh,
                   stride_tail_row, stride_tail_h, BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr,
                   HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, TAIL: gl.constexpr,
                   K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, S_SMEM: gl.constexpr, S_READ: gl.constexpr,
                   num_warps: gl.constexpr):
    """A tile is num_warps × 32 keys, warp w's 32 its own; per warp scores [16, 32] = q · K^T and output
    [16, head_dim] += p · V as mma.sync fp16 × fp16 → fp32 (rows 0-7 the group's heads, 8-15 padding)."""
    W: gl.constexpr = num_warps
    BLOCK_N: gl.constexpr = W * 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(0, MMA, 4)
    OPB: gl.constexpr = gl.DotOperandLayout(1, MMA, 4)
    KC: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32 // (HEAD_DIM // 16), HEAD_DIM // 16], [W, 1, 1], [2, 1, 0])
    VC: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 16, 2], [W, 1, 1], [2, 1, 0])
    SC: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [W, 1, 1], [2, 1, 0])
    kv_head, seq, split, runs, part_start, part_end, is_own, own_first, context_len = _program_keys(
        lens_ptr, 1073741824, num_splits, BLOCK_N, BLOCK_SIZE, TAIL)
    if runs:
        table = tables_ptr + seq.to(gl.int64) * stride_bt
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W, 32, HEAD_DIM], K_SMEM)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W, HEAD_DIM, 32], V_SMEM)
        s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, W, 32, 2], S_SMEM)
        for s in gl.static_range(STAGES - 1):
            first = part_start + s * BLOCK_N
            k_ids, v_ids, s_ids = _warp_blocks(table, first, part_end, BLOCK_SIZE, W, KC, VC, SC)
            _issue(k_smem.index(s), v_smem.index(s), s_smem.index(s), k_ptr, v_ptr, s_ptr, k_ids, v_ids, s_ids, first,
                   part_end, kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd, stride_sb,
                   stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, W, KC, VC, SC)
            cp.commit_group()
        k_blocks, v_blocks, s_blocks = _warp_blocks(table, part_start + (STAGES - 1) * BLOCK_N, part_end, BLOCK_SIZE,
                                                    W, KC, VC, SC)
        q_a, q_scale = _load_q(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, HEAD_DIM, W, QL, OPA)
        s_zero = gl.zeros([W, 16, 32], gl.float32, MMA)
        halves = _row_halves(s_zero)[0]  # [W, 8, 32] zeros in the layout of the scores' halves
        rows8 = gl.max(halves, 2)  # [W, 8] zeros in their per-row layout
        KEYS: gl.constexpr = gl.SliceLayout(1, halves.type.layout)  # [W, 32]: a per-key value, as a score's column
        col_scale = gl.convert_layout(q_scale, rows8.type.layout) * qk_scale
        m_i = rows8 + float("-inf")
        l_i = rows8
        unit = rows8 + 1.0  # acc holds the output times `unit` (the warp's last w_mul)
        acc = gl.zeros([W, 16, HEAD_DIM], gl.float32, MMA)
        key_ids = (gl.arange(0, W, gl.SliceLayout(1, KEYS))[:, None] * 32
                   + gl.arange(0, 32, gl.SliceLayout(0, KEYS))[None, :])
        for t in range(gl.cdiv(part_end - part_start, BLOCK_N)):
            start = part_start + t * BLOCK_N
            stage = t % STAGES
            cp.wait_group(STAGES - 2)  # tile t's copies (this thread's), then everyone's: the barrier also ends every
            gl.thread_barrier()  # warp's reads of the stage refilled next, tile t - 1's (so no second barrier)
            ahead = (t + STAGES - 1) % STAGES
            issue = start + (STAGES - 1) * BLOCK_N
            _issue(k_smem.index(ahead), v_smem.index(ahead), s_smem.index(ahead), k_ptr, v_ptr, s_ptr, k_blocks,
                   v_blocks, s_blocks, issue, part_end, kv_head, stride_kb, stride_kt, stride_kh, stride_vb,
                   stride_vh, stride_vd, stride_sb, stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, W, KC, VC, SC)
            cp.commit_group()
            k_blocks, v_blocks, s_blocks = _warp_blocks(table, issue + BLOCK_N, part_end, BLOCK_SIZE, W, KC, VC, SC)
            s16 = mma_v2(q_a, k_smem.index(stage).permute((0, 2, 1)).load(OPB).to(gl.float16), s_zero)
            k_scale, v_scale = gl.split(s_smem.index(stage).load(S_READ))
            k_scale = gl.convert_layout(k_scale, KEYS, assert_trivial=True).to(gl.float32)
            v_scale = gl.convert_layout(v_scale, KEYS, assert_trivial=True).to(gl.float32)
            scores = _row_halves(s16)[0] * col_scale[:, :, None] * k_scale[:, None, :]
            scores = gl.where(((start + key_ids) < part_end)[:, None, :], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, 2))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp with no key yet: p = 0, alpha = 0
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(scores - m_use[:, :, None])
            l_i = l_i * alpha + gl.sum(p, 2)
            v_wide = halves + v_scale[:, None, :]
            v_max = gl.max(v_wide, 2)  # [W, 8]: the warp's, on every row (no layout conversion)
            w_mul = gl.where(v_max > 0, 1.0 / v_max, 1.0)  # p ≤ 1: p · v_scale · w_mul ≤ 1, fp16's best range
            w = (p * v_wide * w_mul[:, :, None]).to(gl.float16)
            factor = alpha * (w_mul / unit)
            unit = w_mul
            acc_top, acc_pad = _row_halves(acc)
            factor = gl.convert_layout(factor, gl.SliceLayout(2, acc_top.type.layout), assert_trivial=True)
            acc = gl.convert_layout(_stack_rows(acc_top * factor[:, :, None], acc_pad), MMA, assert_trivial=True)
            acc = mma_v2(gl.convert_layout(_stack_rows(w, gl.zeros_like(w)), OPA),
                         v_smem.index(stage).permute((0, 2, 1)).load(OPB).to(gl.float16), acc)
            m_i = m_new
        cp.wait_group(0)
        m, l_sum, out = _merge_warps(acc, m_i, l_i, unit)
        if TAIL:  # the own block's keys [own_first, context_len), exact, from the tail (all masked but in one split)
            m, l_sum, out = _add_own_block(m, l_sum, out, q_ptr, k_tail_ptr, v_tail_ptr, slots_ptr, seq, kv_head,
                                           own_first, context_len, is_own, qk_scale, stride_qb, stride_qh,
                                           stride_tail_row, stride_tail_h, GROUP, HEAD_DIM, BLOCK_SIZE, W)
        _store(m, l_sum, out, seq, kv_head, split, num_splits, out_ptr, part_acc_ptr, part_ml_ptr, stride_ob,
               stride_oh, GROUP, HEAD_DIM, SPLIT)


@_jit
def _merge_warps(acc, m_i, l_i, unit):
    """The warps' (max, sum, output) merged: [8], [8], [8, head_dim] (rows past the group are padding)."""
    acc_top = _row_halves(acc)[0]
    m = gl.max(m_i, 0)  # [8]
    f = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - gl.where(m == float("-inf"), 0.0, m)[None, :]))
    f_out = gl.convert_layout(f / unit, gl.SliceLayout(2, acc_top.type.layout))
    out = gl.sum(acc_top * f_out[:, :, None], 0)
    return m, gl.convert_layout(gl.sum(l_i * f, 0), m.type.layout), out


@_jit
def _first_rows(x):
    """[16] → its rows 0-7 (the group's; rows 8-15 are padding)."""
    return gl.split(gl.permute(gl.reshape(x, [2, 8]), (1, 0)))[0]


@_jit
def _first_rows_2d(x):
    """[16, C] → its rows 0-7."""
    C: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [2, 8, C]), (1, 2, 0)))[0]


@_jit
def _add_own_block(m, l_sum, out, q_ptr, k_tail_ptr, v_tail_ptr, slots_ptr, seq, kv_head, first, end, is_own,
                   qk_scale, stride_qb, stride_qh, stride_tail_row, stride_tail_h, GROUP: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, W: gl.constexpr):
    """(m, l_sum, out) with the keys [first, end) folded in, exact: q and the tail rows' K / V in bf16, bf16 mma.sync
    (the probabilities rounded to bf16, as attention.py's _attend_exact); nothing where not is_own."""
    M2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    rows = gl.arange(0, 16, gl.SliceLayout(1, LD))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, LD))
    q = gl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :],
                mask=((rows < GROUP) & is_own)[:, None], other=0.0)
    keys = first + gl.arange(0, BLOCK_SIZE, gl.SliceLayout(1, LD))
    key_ok = (keys < end) & is_own
    at = (kv_quant.tail_row_tl(gl.load(slots_ptr + seq).to(gl.int64), keys, BLOCK_SIZE) * stride_tail_row
          + kv_head * stride_tail_h)[:, None] + dims[None, :]
    k = gl.load(k_tail_ptr + at, mask=key_ok[:, None], other=0.0)
    v = gl.load(v_tail_ptr + at, mask=key_ok[:, None], other=0.0)
    scores = mma_v2(gl.convert_layout(q, gl.DotOperandLayout(0, M2, 2)),
                    gl.convert_layout(gl.permute(k, (1, 0)), gl.DotOperandLayout(1, M2, 2)),
                    gl.zeros([16, BLOCK_SIZE], gl.float32, M2)) * qk_scale
    cols = first + gl.arange(0, BLOCK_SIZE, gl.SliceLayout(0, M2))
    scores = gl.where(((cols < end) & is_own)[None, :], scores, float("-inf"))
    m_t = gl.convert_layout(_first_rows(gl.max(scores, 1)), m.type.layout)
    m_new = gl.maximum(m, m_t)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scores - gl.convert_layout(_stack_rows2(m_use), gl.SliceLayout(1, M2))[:, None])
    pv = mma_v2(gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(0, M2, 2)),
                gl.convert_layout(v, gl.DotOperandLayout(1, M2, 2)), gl.zeros([16, HEAD_DIM], gl.float32, M2))
    alpha = gl.where(m == float("-inf"), 0.0, gl.exp2(m - m_use))
    l_t = gl.convert_layout(_first_rows(gl.sum(p, 1)), m.type.layout)
    out = out * gl.convert_layout(alpha, gl.SliceLayout(1, out.type.layout))[:, None] + \
        gl.convert_layout(_first_rows_2d(pv), out.type.layout)
    return m_new, l_sum * alpha + l_t, out


@_jit
def _stack_rows2(x):
    """[8] → [16]: x in rows 0-7 and again in rows 8-15 (padding rows, never stored)."""
    return gl.reshape(gl.permute(gl.join(x, x), (1, 0)), [16])


@_jit
def _store(m, l_sum, out, seq, kv_head, split, num_splits, out_ptr, part_acc_ptr, part_ml_ptr, stride_ob, stride_oh,
           GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    """The partition's (max, sum, output): the partial, or with one split the output."""
    OUT: gl.constexpr = out.type.layout
    rows = gl.arange(0, 8, gl.SliceLayout(1, OUT))
    dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, OUT))
    heads = kv_head * GROUP + rows
    ok = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    if SPLIT:
        part = (seq * (gl.num_programs(0) * GROUP) + heads).to(gl.int64) * num_splits + split
        gl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=ok)
        ml_rows = gl.arange(0, 8, m.type.layout)
        ml_part = (seq * (gl.num_programs(0) * GROUP) + kv_head * GROUP + ml_rows).to(gl.int64) * num_splits + split
        gl.store(part_ml_ptr + ml_part * 2, m, mask=ml_rows < GROUP)
        gl.store(part_ml_ptr + ml_part * 2 + 1, l_sum, mask=ml_rows < GROUP)
    else:
        l_out = gl.convert_layout(l_sum, gl.SliceLayout(1, OUT))
        out = out / gl.where(l_out > 0, l_out, 1.0)[:, None]
        gl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok)
