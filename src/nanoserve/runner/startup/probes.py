"""The steps start-up runs before any request: decode and mixed probe batches over disjoint KV blocks, with random
inputs, loaded into the runner's own static buffers (the curve probes time them, the self-check compares their
replays with the eager forward). No request may be running meanwhile."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.kernels.paging import kv_slots
from nanoserve.runner.batch import BlockUpdates, PrefillBatch, disjoint_decode_batch, disjoint_verify_batch
from nanoserve.runner.buffers import StepBuffers
from nanoserve.runner.kv_cache import KVCacheSpec

PROBE_CONTEXT = 512  # tokens per row in the start-up probes and self-check


@dataclass
class Probes:
    buffers: StepBuffers
    config: EngineConfig
    kv: KVCacheSpec
    num_kv_blocks: int
    vocab_size: int
    rng: torch.Generator  # device draws (input tokens): the same on every tensor-parallel rank
    host_rng: torch.Generator  # context lengths and prompt ids

    def load_decode(self, rows: int, context: int | None = None) -> None:
        """A decode batch of `rows` real rows over disjoint blocks, with fresh random input tokens."""
        longest = self._longest_context()
        c = self.config
        self._load(rows, *disjoint_decode_batch(rows, min(context or longest, longest), c.block_size,
                                                self.num_kv_blocks))

    def load_verify(self, rows: int) -> None:
        """load_decode's rows as verifications: runs of 1 + num_speculative_tokens rows share a sequence (its last
        token, then drafts), as the engine batches a sequence that verifies drafts (the attention reads them as one
        group)."""
        c = self.config
        self._load(rows, *disjoint_verify_batch(rows, self.buffers.decode_forward.seq_rows, self._longest_context(),
                                                c.block_size, self.num_kv_blocks))

    def _longest_context(self) -> int:
        """A probe row's context: PROBE_CONTEXT, within each sequence's share of the cache and max_model_len."""
        c = self.config
        per_row = self.num_kv_blocks // max(c.max_num_seqs, 1)
        return max(1, min(PROBE_CONTEXT, per_row * c.block_size, c.max_model_len))

    def _load(self, rows: int, batch, tables: np.ndarray) -> None:
        """A probe batch into the decode inputs: its slots' tables (slots 0..len(tables)-1), random last tokens."""
        self.buffers.state.write_tables(np.arange(len(tables), dtype=np.int32), tables)
        self.buffers.state.last_tokens[:rows].random_(0, self.vocab_size, generator=self.rng)
        self.buffers.decode_forward.load(batch, rows)

    def load_decode_check(self, rows: int) -> None:
        """Like load_decode, at a random context length: no two checks see the same inputs."""
        self.load_decode(rows, int(torch.randint(1, PROBE_CONTEXT + 1, (), generator=self.host_rng).item()))

    def mixed_batch(self, tokens: int) -> PrefillBatch:
        """A mixed step of `tokens` tokens over disjoint blocks: decode rows (one token after a 255-token context),
        prompt chunks after a 128-token cached prefix and fresh ones (each within max_model_len); random ids;
        every sequence samples."""
        longest, most = self.config.max_model_len, self.config.max_num_seqs
        cap = max(1, min((tokens + 1) // 2, longest // 2))  # prompt pieces: every other one after a cached prefix
        d = max(0, min(tokens // 8, most - -(-tokens // cap)))
        prefix, specs, rest = min(128, longest - cap), [(min(255, longest - 1), 1)] * d, tokens - d
        while rest > 0 and len(specs) < most:  # (a tiny engine may not fill `tokens`: the rest is padding)
            n = min(cap, rest)
            specs.append((prefix if (len(specs) - d) % 2 == 0 else 0, n))
            rest -= n
        specs = self._fit_cache(specs)
        tables = self._write_disjoint_tables(specs)
        bs, token_ids, slot_mapping = self.config.block_size, [], []
        for i, (start, n) in enumerate(specs):
            slot_mapping.append(kv_slots(tables[i], np.arange(start, start + n), bs))
            token_ids.append(np.full(1, -1) if n == 1 else torch.randint(0, self.vocab_size, (n,),
                                                                         generator=self.host_rng).numpy())
        starts, lens = (np.array(x, np.int32) for x in zip(*specs))
        slots = np.arange(len(specs), dtype=np.int32)
        return PrefillBatch(slots, starts, lens, np.concatenate(token_ids).astype(np.int32),
                            np.concatenate(slot_mapping).astype(np.int32), BlockUpdates(), slots, None, tables.shape[1])

    def load_mixed(self, tokens: int):
        """mixed_batch(tokens) loaded into the token-count graphs' static inputs: (the batch, its tail views)."""
        batch = self.mixed_batch(tokens)
        return batch, self.buffers.token_forward.load(self.buffers.token_forward.arrays(batch), tokens)

    def _write_disjoint_tables(self, specs: list[tuple[int, int]]) -> np.ndarray:
        """Slots 0..len(specs)-1 get disjoint block tables for their (start, tokens); their last tokens random."""
        blocks = [self.kv.blocks_for(s + n) for s, n in specs]
        slots = np.arange(len(specs), dtype=np.int32)
        tables = np.full((len(specs), max(blocks)), self.buffers.dummy_block, np.int32)
        first = np.cumsum([0] + blocks)
        for i, n in enumerate(blocks):
            tables[i, :n] = np.arange(first[i], first[i + 1])
        self.buffers.state.write_tables(slots, tables)
        self.buffers.state.last_tokens[:len(specs)].random_(0, self.vocab_size, generator=self.rng)
        return tables

    def _fit_cache(self, specs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(start, tokens) sequences trimmed to disjoint blocks of this KV cache (a small cache: decode rows over one
        block, then fewer tokens; the graph's padding takes the rest)."""
        bs = self.config.block_size
        if sum(self.kv.blocks_for(s + n) for s, n in specs) > self.num_kv_blocks:
            specs = [(min(s, bs - 1), n) if n == 1 else (s, n) for s, n in specs]
        kept, free = [], self.num_kv_blocks
        for start, n in specs:
            n = min(n, free * bs - start)
            if n <= 0:
                break
            kept.append((start, n))
            free -= self.kv.blocks_for(start + n)
        return kept


__all__ = ["Probes", "PROBE_CONTEXT"]
