"""The sampler's kernels: the plain sample in one launch, and the float32 copy of the logits with the token bitmask.

Why one launch: the loop is host-bound at small models and batch sizes, and the sampler's torch ops (~15 of them for
temperature sampling: scale, softmax, noise, race, argmax, casts, the store into the slots' last-token cells) cost
more host time than the device spends on them. `sample_tokens` does the common case (each row greedy or sampled at a
temperature, an optional grammar bitmask, nothing else) in one kernel: it reads the logits once, masks, scales, adds
Gumbel noise (argmax of logit / T + G with G = -log(-log U) draws from softmax(logit / T): the Gumbel-max trick), and
reduces each row's argmax across its programs with a 64-bit atomic max of (score, -index) keys; the row's last
program writes the token and stores it in its slot's last-token cell, and resets the row's scratch for the next call.

U comes from Philox 4x32-10 (triton's randint4x) keyed by a per-call seed, counter = the row's offset + the column's
lane, so the draws are fixed by (seed, row, column) whatever the grid: `sample_tokens_ref` recomputes them in numpy,
the kernel's oracle.

The bitmask is xgrammar's layout: [rows, ceil(vocab / 32)] int32, bit j of word w allows token 32w + j. The rest of
the sampler (top-k, top-p, min-p, logprobs, bans, biases, penalties, seeded rows) works on a float32 copy of the
logits, which a constrained step makes masked (`masked_float_logits`: xgrammar's apply_token_bitmask_inplace costs
more host time a call in its Python wrapper; measured: notes/PERF.md, issue 34 figures, kernels/sampling.py).
"""
from __future__ import annotations

import numpy as np
import torch

from nanoserve.kernels._triton import cdiv, jit, tl, use_triton

MASK_BLOCK = 2048  # tokens per program of the masked copy: 64 rows of a 152k vocabulary are ~4.8k programs
SAMPLE_LANES = 256  # columns per Philox lane block: one randint4x call gives the noise of 4 such blocks
SAMPLE_BLOCK = 4 * SAMPLE_LANES  # columns per iteration of the sample kernel
SAMPLE_ITERS = 4  # iterations per program: 4096 columns, so a 152k vocabulary is 38 programs a row


def masked_float_logits_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, vocab] with every token whose bit is 0 at -inf (plain PyTorch)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    return logits.float().masked_fill(~allowed, float("-inf"))


def masked_float_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, vocab] with every token whose bit is 0 at -inf; bitmask [n, >= ceil(vocab / 32)] int32 on
    the logits' device. A new tensor: the logits are left as they are."""
    n, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != n or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a token bitmask for {n} rows of {vocab} tokens is int32 [{n}, >= {cdiv(vocab, 32)}], "
                         f"got {bitmask.dtype} {list(bitmask.shape)}")
    if not use_triton(logits):
        return masked_float_logits_ref(logits, bitmask)
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n:
        _masked_float_logits_kernel[(n, cdiv(vocab, MASK_BLOCK))](logits, bitmask, out, vocab, logits.stride(0),
                                                                 bitmask.stride(0), BLOCK=MASK_BLOCK)
    return out


@jit
def _masked_float_logits_kernel(logits_ptr, mask_ptr, out_ptr, vocab, stride_logits, stride_mask,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=inside, other=0.0).to(tl.float32)
    words = tl.load(mask_ptr + row * stride_mask + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(out_ptr + row * vocab + cols, tl.where(allowed, x, float("-inf")), mask=inside)



class SampleScratch:
    """The per-row state of sample_tokens' cross-program reduction, allocated once: the best key so far (reset to
    the lowest int64) and the count of programs done (reset to 0), each reset by the row's last program."""

    def __init__(self, max_rows: int, device: torch.device):
        self.best = torch.full((max_rows,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
        self.done = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int32, device=device)


def sample_tokens(logits: torch.Tensor, bitmask: torch.Tensor | None, temperature: torch.Tensor,
                  seed: torch.Tensor, slots: torch.Tensor, last_tokens: torch.Tensor,
                  scratch: SampleScratch) -> torch.Tensor:
    """Per row: the argmax of the (masked) logits where temperature[row] <= 0, else a draw from softmax(logits / T);
    stored at last_tokens[slots[row]]; returned as an int32 [n] view of the scratch (valid until the next call).
    seed: this call's noise key, an int64 [1] tensor on the logits' device (read by the kernel, so a CUDA graph of
    the call draws anew when the caller advances it). A Triton kernel (CUDA, or the interpreter)."""
    n, vocab = logits.shape
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape[0] != n or bitmask.shape[1] * 32 < vocab):
        raise ValueError(f"a token bitmask for {n} rows of {vocab} tokens is int32 [{n}, >= {cdiv(vocab, 32)}], "
                         f"got {bitmask.dtype} {list(bitmask.shape)}")
    tokens = scratch.tokens[:n]
    if n:
        chunk = SAMPLE_BLOCK * SAMPLE_ITERS
        mask = bitmask if bitmask is not None else tokens  # (unused: HAS_MASK is off)
        _sample_kernel[(n, cdiv(vocab, chunk))](
            logits, logits.stride(0), mask, mask.stride(0) if bitmask is not None else 0, temperature, slots,
            last_tokens, tokens, scratch.best, scratch.done, seed, vocab, cdiv(vocab, chunk),
            cdiv(vocab, SAMPLE_BLOCK) * SAMPLE_LANES, HAS_MASK=bitmask is not None, LANES=SAMPLE_LANES,
            ITERS=SAMPLE_ITERS)
    return tokens


def philox_uniform_ref(seed: int, counters: np.ndarray) -> np.ndarray:
    """Philox 4x32-10 of (counter, 0, 0, 0) under the key (seed, 0), as triton's randint4x computes it: [4, len]
    uint32 words, turned into floats in (0, 1) as the kernel does (the top 23 bits plus half a step: 1 - 2**-24 at
    most, which float32 holds exactly; 24 bits would round the top draw to 1.0, whose noise is infinite)."""
    mask = np.uint64(0xFFFFFFFF)
    c = [counters.astype(np.uint64), *(np.zeros_like(counters, np.uint64) for _ in range(3))]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        prod_b, prod_a = np.uint64(0xCD9E8D57) * c[2], np.uint64(0xD2511F53) * c[0]
        c = [(prod_b >> np.uint64(32)) ^ c[1] ^ k0, prod_b & mask, (prod_a >> np.uint64(32)) ^ c[3] ^ k1, prod_a & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return uniform_ref(np.stack(c).astype(np.uint32))


def uniform_ref(words: np.ndarray) -> np.ndarray:
    """uint32 words → float32 in (0, 1), as the kernel turns them."""
    return (((words >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)).astype(np.float32)


def sample_tokens_ref(logits: torch.Tensor, bitmask: torch.Tensor | None, temperature: torch.Tensor,
                      seed: int) -> torch.Tensor:
    """What sample_tokens returns, in numpy and PyTorch: the same Philox draws, masking and scores (CPU, float32)."""
    n, vocab = logits.shape
    x = logits.float().cpu()
    if bitmask is not None:
        x = masked_float_logits_ref(x, bitmask.cpu())
    cols = np.arange(vocab)
    blocks, within = cols // SAMPLE_BLOCK, cols % SAMPLE_BLOCK
    out = torch.empty(n, dtype=torch.int32)
    row_lanes = cdiv(vocab, SAMPLE_BLOCK) * SAMPLE_LANES
    for row in range(n):
        t = float(temperature[row])
        if t <= 0:
            out[row] = int(x[row].argmax())
            continue
        counters = row * row_lanes + blocks * SAMPLE_LANES + within % SAMPLE_LANES
        u = philox_uniform_ref(seed, counters)[within // SAMPLE_LANES, cols]
        gumbel = torch.from_numpy(-np.log(-np.log(u)))
        scores = x[row] * (np.float32(1.0) / np.float32(t)) + gumbel
        out[row] = int(scores.argmax())
    return out


@jit
def _sample_kernel(logits_ptr, stride_logits, mask_ptr, stride_mask, temp_ptr, slots_ptr, last_ptr, tokens_ptr,
                   best_ptr, done_ptr, seed_ptr, vocab, num_programs, row_lanes,
                   HAS_MASK: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr):
    row = tl.program_id(0)
    program = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    sampled = t > 0
    inv_t = 1.0 / tl.where(sampled, t, 1.0)
    lanes = tl.arange(0, LANES)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits
    row_mask = mask_ptr + row.to(tl.int64) * stride_mask
    best = tl.full((LANES,), -2**63, tl.int64)
    seed = tl.load(seed_ptr)
    for it in range(ITERS):
        block = program * ITERS + it
        if sampled:  # (uniform per program: greedy rows skip the Philox rounds)
            r0, r1, r2, r3 = tl.randint4x(seed, (row * row_lanes + block * LANES + lanes).to(tl.uint32))
        else:
            r0 = tl.zeros((LANES,), tl.uint32)
            r1, r2, r3 = r0, r0, r0
        for k in tl.static_range(4):
            cols = (block * 4 + k) * LANES + lanes
            inside = cols < vocab
            x = tl.load(row_logits + cols, mask=inside, other=0.0).to(tl.float32)
            if sampled:
                r = r0 if k == 0 else (r1 if k == 1 else (r2 if k == 2 else r3))
                u = ((r >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)  # in (0, 1): 1 - 2**-24 at most, exactly
                x = x * inv_t - tl.log(-tl.log(u))
            keep = inside & (x == x)  # (a NaN logit is never taken)
            if HAS_MASK:  # after the noise: a forbidden token stays at -inf whatever its draw
                words = tl.load(row_mask + cols // 32, mask=inside, other=0)
                keep = keep & (((words >> (cols % 32)) & 1) != 0)
            bits = tl.where(keep, x, float("-inf")).to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order == float order
            best = tl.maximum(best, (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - cols.to(tl.int64)))
    tl.atomic_max(best_ptr + row, tl.max(best, axis=0))
    tl.debug_barrier()  # this program's max is in before it counts itself done
    finished = tl.atomic_add(done_ptr + row, 1)
    if finished == num_programs - 1:  # the row's last program: every other program's max is in
        tl.debug_barrier()
        key = tl.atomic_xchg(best_ptr + row, -2**63)
        tl.atomic_xchg(done_ptr + row, 0)
        token = (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)
        tl.store(tokens_ptr + row, token)
        tl.store(last_ptr + tl.load(slots_ptr + row), token)
