"""A scheduled step → the runner's plain batch (runner/batch.py): slots, positions, KV slots, block-table
updates and per-row sampling parameters, built in O(rows) with no per-token Python list copies."""
from __future__ import annotations

import numpy as np

from nanoserve.engine.scheduler import ScheduledStep
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.paging import kv_slots
from nanoserve.runner.batch import BlockUpdates, DecodeBatch, Penalties, PrefillBatch, SamplingBatch
from nanoserve.runner.speculative import DEVICE_DRAFT


def build_batch(step: ScheduledStep, block_size: int, eos_token_ids: list[int], max_decode_rows: int = 0,
                on_device: bool = False, sampled_drafts: bool = False) -> DecodeBatch | PrefillBatch:
    """Call right after scheduling: the sequences' block tables, slots and pending counts are this step's. A step
    whose every row decodes, some verifying drafts, runs as a decode batch of one row per token when those fit
    max_decode_rows (the batch-size graphs), else as a token-count step. on_device: drafts are proposed on the device
    (runner/speculative.DraftState): decode rows take their positions from it, prompt tokens are recorded there.
    sampled_drafts: a draft model samples the device drafts of requests at temperature > 0 in decode batches (the
    rows that check them are marked: SamplingBatch.draft_sampled)."""
    rows = [(s, d) for s, samples, d in zip(step.seqs, step.samples, step.drafts) if samples]
    sampling = sampling_batch([s for s, _ in rows], eos_token_ids, [d for _, d in rows]) if rows else None
    if step.is_decode:
        batch = _decode_batch(step, block_size, sampling)
    elif all(step.decode_rows) and sum(step.num_new_tokens) <= max_decode_rows:
        batch = _verify_batch(step, block_size, sampling)
        if sampled_drafts:
            _mark_sampled_drafts(sampling, step)
    else:  # (device drafts here only from a draft model: the scheduler's rule)
        batch = _prefill_batch(step, block_size, block_updates(step.seqs), sampling)
    if on_device:
        _from_device(batch, step)
    return batch


def _mark_sampled_drafts(sampling: SamplingBatch, step: ScheduledStep) -> None:
    """The rows that check a device draft of an unseeded request at temperature > 0 (its draft comes from the draft
    model's distribution; a seeded request's drafts stay greedy, so its draws are all its own)."""
    flags = [int(j < len(d) and d[0] == DEVICE_DRAFT and not seq.params.greedy and seq.generator is None)
             for seq, d in zip(step.seqs, step.drafts) for j in range(1 + len(d))]
    if any(flags):
        sampling.draft_sampled = np.array(flags, np.int32)


def _from_device(batch: DecodeBatch | PrefillBatch, step: ScheduledStep) -> None:
    """Drafting on the device: a decode batch's rows take their positions from the device, a sequence whose drafts
    come from there proposes them at its first row; a prompt step records the prompt tokens it makes known (a first
    chunk after a prefix hit: the cached ones too)."""
    if isinstance(batch, DecodeBatch):
        batch.from_device = np.ones(batch.size, np.int32)
        batch.draft_slots = np.full(batch.size, -1, np.int32)
        row = 0
        for seq, drafts in zip(step.seqs, step.drafts):
            if drafts and drafts[0] == DEVICE_DRAFT:
                batch.draft_slots[row] = seq.slot
            row += 1 + len(drafts)
        return
    spans = [(seq, 0 if start == seq.num_cached_tokens else start, start + n) for seq, start, n, decode in
             zip(step.seqs, step.starts, step.num_new_tokens, step.decode_rows) if not decode]
    if spans:
        batch.known_slots = np.concatenate([np.full(end - first, seq.slot, np.int32) for seq, first, end in spans])
        batch.known_positions = np.concatenate([np.arange(first, end, dtype=np.int32) for _, first, end in spans])
        batch.known_ids = np.concatenate([np.array(seq.tokens_between(first, end), np.int32)
                                          for seq, first, end in spans])


def _decode_batch(step: ScheduledStep, bs: int, sampling) -> DecodeBatch:
    n = len(step.seqs)
    positions = np.array(step.starts, dtype=np.int32)
    slot_mapping = kv_slots([s.block_table for s in step.seqs], positions, bs)
    slots = np.fromiter((s.slot for s in step.seqs), dtype=np.int32, count=n)
    cols, ids = np.full(n, -1, np.int32), np.zeros(n, np.int32)
    for i, seq in enumerate(step.seqs):
        if seq.num_synced_blocks < len(seq.block_table):  # a decode step adds at most one block
            assert seq.num_synced_blocks == len(seq.block_table) - 1, "a decoding sequence's table is in sync"
            cols[i], ids[i] = seq.num_synced_blocks, seq.block_table[-1]
            seq.num_synced_blocks += 1
    return DecodeBatch(slots, positions, slot_mapping, positions + 1, cols, ids, sampling)


def _verify_batch(step: ScheduledStep, bs: int, sampling) -> DecodeBatch:
    """Each sequence as consecutive decode rows of its slot: its last token (read on the device), then its drafts, each
    at its own position and context length; a new block is brought by the first row in its column
    (kernels/step_inputs.py: the rows after it read it from that row). Rows gathered in lists, one array per field:
    per-sequence arrays cost more than the rows (k = 4 on this CPU: b = 1 12.9 → 7.8 µs, b = 32 260 → 48)."""
    slots, positions, back, tables, tokens, drafts, new_blocks = [], [], [], [], [], [], []
    for seq, start, draft in zip(step.seqs, step.starts, step.drafts):
        n, at = 1 + len(draft), len(positions)
        for col in range(seq.num_synced_blocks, len(seq.block_table)):
            row = max(col * bs - start, 0)
            assert row < n and (not new_blocks or new_blocks[-1][0] < at + row), \
                "one new block per row, within the sequence's rows"
            new_blocks.append((at + row, col, seq.block_table[col]))
        seq.num_synced_blocks = len(seq.block_table)
        slots += [seq.slot] * n
        positions += range(start, start + n)
        back += range(n)
        tables += [seq.block_table] * n
        tokens += (-1, *draft)
        drafts += (*draft, -1)
    positions = np.array(positions, np.int32)
    cols, ids = np.full(len(positions), -1, np.int32), np.zeros(len(positions), np.int32)
    if new_blocks:
        rows, new_cols, new_ids = (list(x) for x in zip(*new_blocks))
        cols[rows], ids[rows] = new_cols, new_ids
    slot_mapping, slots = kv_slots(tables, positions, bs), np.array(slots, np.int32)
    tokens, drafts, back = np.array(tokens, np.int32), np.array(drafts, np.int32), np.array(back, np.int32)
    return DecodeBatch(slots, positions, slot_mapping, positions + 1, cols, ids, sampling, token_ids=tokens,
                       draft_ids=drafts, group_back=back)


def _prefill_batch(step: ScheduledStep, bs: int, updates: BlockUpdates, sampling) -> PrefillBatch:
    token_ids, slot_mapping = [], []
    for seq, start, n, decode, drafts in zip(step.seqs, step.starts, step.num_new_tokens, step.decode_rows,
                                             step.drafts):
        if decode:  # its input is the token it sampled last, on the device; then its drafts
            token_ids.append(np.array([-1, *drafts], np.int32))
            slot_mapping.append(kv_slots(seq.block_table, np.arange(start, start + n), bs))
        else:
            token_ids.append(np.array(seq.tokens_between(start, start + n), np.int32))
            slot_mapping.append(kv_slots(seq.block_table, np.arange(start, start + n), bs))
    sample_rows = np.flatnonzero(step.samples).astype(np.int32)
    batch = PrefillBatch(
        slots=np.fromiter((s.slot for s in step.seqs), dtype=np.int32, count=len(step.seqs)),
        starts=np.array(step.starts, np.int32), query_lens=np.array(step.num_new_tokens, np.int32),
        token_ids=np.concatenate(token_ids), slot_mapping=np.concatenate(slot_mapping), block_updates=updates,
        sample_rows=sample_rows, sampling=sampling, max_blocks=max(len(s.block_table) for s in step.seqs))
    if step.has_drafts:
        drafts = [d for d, samples in zip(step.drafts, step.samples) if samples]
        batch.sample_counts = np.fromiter((1 + len(d) for d in drafts), np.int32, len(drafts))
        batch.draft_ids = np.concatenate([np.array([*d, -1], np.int32) for d in drafts])
    if any(s.params.prompt_logprobs is not None for s in step.seqs):
        _prompt_logprob_rows(batch, step)
    return batch


def _prompt_logprob_rows(batch: PrefillBatch, step: ScheduledStep) -> None:
    """The chunk rows whose next prompt token's logprob is asked for (each prompt position once, even when a
    preempted sequence recomputes its prompt): position p of a prompt of L tokens predicts token p + 1 < L."""
    rows, targets, k, at = [], [], 0, 0
    for seq, start, n, decode in zip(step.seqs, step.starts, step.num_new_tokens, step.decode_rows):
        want = seq.params.prompt_logprobs
        if want is not None and not decode:
            first = max(start, seq.num_prompt_logprobs_scheduled)
            end = min(start + n, seq.num_prompt_tokens - 1)
            if end > first:
                rows.append(np.arange(at + first - start, at + end - start, dtype=np.int32))
                targets.append(np.asarray(seq.prompt_token_ids[first + 1:end + 1], np.int32))
                seq.num_prompt_logprobs_scheduled = end
                k = max(k, want)
        at += n
    if rows:
        batch.prompt_logprob_rows, batch.prompt_logprob_targets = np.concatenate(rows), np.concatenate(targets)
        batch.prompt_logprob_k = k


def distribute_prompt_logprobs(step: ScheduledStep, results: list) -> None:
    """A step's prompt logprobs, in the order batching listed their rows, to their sequences."""
    at = 0
    for seq, start, n, decode in zip(step.seqs, step.starts, step.num_new_tokens, step.decode_rows):
        if seq.params.prompt_logprobs is not None and not decode:
            count = min(start + n, seq.num_prompt_tokens - 1) - max(start, len(seq.prompt_logprobs))
            if count > 0:
                seq.prompt_logprobs += results[at:at + count]
                at += count


def block_updates(seqs: list[Sequence]) -> BlockUpdates:
    """The block-table entries the device does not have yet (a joining sequence's whole table, else new blocks)."""
    slots, cols, ids = [], [], []
    for seq in seqs:
        start = seq.num_synced_blocks
        new = seq.block_table[start:]
        if new:
            slots += [seq.slot] * len(new)
            cols += range(start, start + len(new))
            ids += new
            seq.num_synced_blocks = len(seq.block_table)
    return BlockUpdates(np.array(slots, np.int32), np.array(cols, np.int32), np.array(ids, np.int32))


def sampling_batch(seqs: list[Sequence], eos_token_ids: list[int],
                   drafts: list[list[int]] | None = None) -> SamplingBatch:
    """Per-row sampling parameters of the sequences that sample this step (their pending count includes it). A
    sequence verifying drafts samples a row at each of its draft positions and one after them (runner/speculative.py):
    row j of it follows its outputs and drafts[:j], so bans (min_tokens) and penalties see that history."""
    drafts = drafts or [[] for _ in seqs]
    if any(drafts):
        return _verify_sampling_batch(seqs, eos_token_ids, drafts)
    n = len(seqs)
    params = [s.params for s in seqs]
    temperature = np.fromiter((0.0 if p.greedy else p.temperature for p in params), np.float32, n)
    batch = SamplingBatch(
        slots=np.fromiter((s.slot for s in seqs), np.int32, n), temperature=temperature,
        top_p=np.fromiter((p.top_p for p in params), np.float32, n),
        top_k=np.fromiter((p.top_k for p in params), np.int32, n),
        min_p=np.fromiter((p.min_p for p in params), np.float32, n))
    if any(s.generator is not None for s in seqs):
        batch.generators = [s.generator for s in seqs]
    if any(p.logprobs is not None for p in params):
        batch.num_logprobs = [p.logprobs for p in params]
    if any(p.min_tokens for p in params):
        _ban_stop_tokens(batch, seqs, [0] * n, eos_token_ids)
    if any(p.logit_bias for p in params):
        _logit_bias(batch, params)
    if any(p.uses_penalties for p in params):
        batch.penalties = Penalties(
            np.fromiter((p.repetition_penalty for p in params), np.float32, n),
            np.fromiter((p.frequency_penalty for p in params), np.float32, n),
            np.fromiter((p.presence_penalty for p in params), np.float32, n),
            [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs])
    return batch


def _verify_sampling_batch(seqs: list[Sequence], eos_token_ids: list[int], drafts: list[list[int]]) -> SamplingBatch:
    """The rows of a verification step: each sequence's parameters repeated over its 1 + len(drafts) rows."""
    counts = [1 + len(d) for d in drafts]
    rows = [(seq, j, c) for seq, c in zip(seqs, counts) for j in range(c)]
    batch = sampling_batch([seq for seq, _, _ in rows], eos_token_ids)
    if any(s.params.min_tokens for s in seqs):
        batch.banned_rows = batch.banned_tokens = np.zeros(0, np.int32)  # (the pending count has all c rows)
        _ban_stop_tokens(batch, [seq for seq, _, _ in rows], [j + 1 - c for _, j, c in rows], eos_token_ids)
    if batch.penalties is not None:  # (only a request with penalties reads its drafts: it never has device drafts)
        history = {id(seq): d if seq.params.uses_penalties else [] for seq, d in zip(seqs, drafts)}
        batch.penalties.output_token_ids = [seq.output_token_ids + history[id(seq)][:j] for seq, j, _ in rows]
    return batch


def _ban_stop_tokens(batch: SamplingBatch, seqs: list[Sequence], ahead: list[int], eos_token_ids: list[int]) -> None:
    """min_tokens: a row whose token is not yet past min_tokens may not sample EOS or its stop_token_ids. ahead[i]:
    row i's token comes that many tokens after its sequence's last pending one (0, or ≤ 0 for a draft position)."""
    rows, tokens = [], []
    for i, (seq, j) in enumerate(zip(seqs, ahead)):
        p = seq.params
        if not p.reached_min_tokens(seq.num_output_tokens - 1 + j):  # this step's token is output num_output_tokens
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows += [i] * len(banned)
            tokens += sorted(banned)
    if rows:
        batch.banned_rows, batch.banned_tokens = np.array(rows, np.int32), np.array(tokens, np.int32)


def _logit_bias(batch: SamplingBatch, params) -> None:
    """Each biased row's (token, bias) pairs, flattened (only the rows that have a logit_bias)."""
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    batch.bias_rows = np.repeat(np.array([i for i, _ in biased], np.int32), [len(b) for _, b in biased])
    batch.bias_tokens = np.fromiter((t for _, b in biased for t in b), np.int32)
    batch.bias_values = np.fromiter((v for _, b in biased for v in b.values()), np.float32)
