"""A draft model on the device (speculative_config "draft_model"): a smaller model with the target's token ids proposes
each verifying sequence's drafts inside the target's own decode step, so the asynchronous loop and the decode graphs
stay (the draft's k forwards are recorded in the same graph as the target's).

Its KV cache mirrors the target's: the same blocks (the scheduler's block tables, slot mapping and prefix cache serve
both), its own tensors. Every forward the target runs — prompt chunks, decode rows, verification rows — the draft runs
too, over the same ids and metadata (mirror()), so wherever the target's cache holds a token the draft's holds it too:
prefix-cache hits, preemption and rolled-back drafts need nothing of their own.

Proposing (propose()), after the step's inputs are resolved (kernels/step_inputs.prepare_decode): a sequence whose
first row r verifies c device drafts feeds its last token at its position p, then each draft it chose, for c steps;
step j runs at row r + j - 1's position, KV slot and block table (the rows the target verifies), so its writes land
where the target's mirror writes the same tokens again. A greedy or seeded request's drafts are the draft's greedy
choices (one-hot: runner/speculative.py's rule is exact); an unseeded sampled request's are drawn from the draft's
distribution q at its temperature, q kept at the row that checks the draft (self.q), and the sampler verifies them by
rejection sampling against it (runner/sampler.against_draft). Each step runs over every row of the bucket (a static
shape); rows that propose nothing write the dummy KV slot. Beside prompts (token-count steps) drafts stay greedy.
"""
from __future__ import annotations

import torch

from nanoserve.kernels.kv_quant import tail_row
from nanoserve.kernels.step_inputs import DEVICE_DRAFT
from nanoserve.model.attention_metadata import AttentionMetadata


class DraftModel:
    def __init__(self, model, k: int, max_rows: int, dummy_kv_slot: int, vocab: int, device: torch.device):
        """model: the draft (its KV cache bound); k: num_speculative_tokens; max_rows: the largest decode bucket;
        vocab: the target's (q's width: the draft's own may be smaller)."""
        self.model, self.k, self.dummy_kv_slot, self.trash = model, k, dummy_kv_slot, max_rows
        self.tail_block_size: int | None = None  # its fp8 cache's tail (kernels/kv_quant.py), set with the cache
        self.no_counts = torch.zeros(max_rows, dtype=torch.int32, device=device)  # prepare_decode resolves no draft
        self.no_drafts = torch.zeros(max_rows, k, dtype=torch.int32, device=device)
        # per decode row, the distribution its draft was sampled from (row `trash` takes the other rows' writes)
        self.q = torch.zeros(max_rows + 1, vocab, dtype=torch.float32, device=device)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The target's forward, run by the draft for its KV writes (its hidden states are not read)."""
        self.model(input_ids, positions, meta)

    def propose(self, input_ids: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, context_lens: torch.Tensor, is_draft: torch.Tensor,
                draft_ids: torch.Tensor, group_back: torch.Tensor, proposing: torch.Tensor,
                temperature: torch.Tensor | None = None, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Over verification rows (a sequence's last token, then its drafts: consecutive rows, group_back[r] of its
        rows before r): the input ids with each proposing sequence's drafts filled in at its is_draft rows, and
        draft_ids (what each row's sample must equal) written in place. proposing[r]: r is the first row of a
        sequence whose drafts come from the device; sampled[r] (with temperature): its drafts are drawn from q =
        softmax(draft logits / temperature), each q kept at the row that checks its draft (self.q), else greedy.
        Graph-capturable (no host sync, static shapes)."""
        rows = input_ids.shape[0]
        r = torch.arange(rows, device=input_ids.device)
        back = group_back.long()
        first = r - back
        counts = torch.zeros(rows, dtype=torch.int32, device=r.device).index_add_(0, first, is_draft.int())
        counts = torch.where(proposing, counts, 0)
        sampling = None if sampled is None else (sampled & proposing, temperature)
        drafts = self._chain(input_ids, tables, slots, positions, slot_mapping, context_lens, counts, sampling)
        ours = proposing[first]  # rows of a proposing sequence's group
        g = back.clamp(max=self.k)
        at = drafts[first]  # [rows, k]: the group's drafts
        filled = at.gather(1, (g - 1).clamp(min=0)[:, None])[:, 0]
        ids = torch.where(ours & is_draft, filled, input_ids)
        verified = at.gather(1, g.clamp(max=self.k - 1)[:, None])[:, 0]
        draft_ids.copy_(torch.where(ours & (back < counts[first]), verified, draft_ids))
        return ids

    def _chain(self, input_ids, tables, slots, positions, slot_mapping, context_lens, counts, sampling) -> torch.Tensor:
        """[rows, k] int32: row r's drafts, d_j from step j (only the first counts[r] mean anything): greedy, or
        (sampling: (rows, temperature)) drawn from q, which goes to self.q at the row that checks the draft."""
        rows = input_ids.shape[0]
        r = torch.arange(rows, device=input_ids.device)
        out = torch.empty(rows, self.k, dtype=torch.int32, device=input_ids.device)
        token = input_ids
        for j in range(self.k):  # step j + 1 feeds the token at row r + j's position
            on = counts > j
            src = torch.where(on, r + j, r).clamp(max=rows - 1)
            meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.where(on, slot_mapping[src],
                                                                                self.dummy_kv_slot),
                                     context_lens=torch.where(on, context_lens[src], 1), block_tables=tables[src],
                                     **self._tail(on, slots[src], positions[src]))
            logits = self.model.compute_logits(self.model(token, positions[src], meta))
            token = logits.argmax(dim=-1).to(torch.int32)
            if sampling is not None:
                token = self._sampled(logits, token, on & sampling[0], sampling[1], r + j)
            out[:, j] = token
        return out

    def _tail(self, on: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> dict:
        """A chain step's tail metadata over an fp8 cache that keeps one (the rows that propose nothing write none)."""
        if self.tail_block_size is None:
            return {}
        rows = tail_row(slots, positions, self.tail_block_size).to(torch.int32)
        return {"table_rows": slots, "tail_rows": torch.where(on, rows, -1)}

    def _sampled(self, logits: torch.Tensor, greedy: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                 checked_at: torch.Tensor) -> torch.Tensor:
        """Rows `rows` draw their draft from q = softmax(logits / temperature) (an exponential race) and keep q at
        row checked_at (the verifying row whose sample is tested against it); the others keep `greedy`."""
        q = (logits.float() / temperature.clamp_min(1e-5)[:, None]).softmax(dim=-1)
        drawn = (q / torch.empty_like(q).exponential_().clamp_min_(1e-10)).argmax(dim=-1).to(torch.int32)
        self.q[:, :q.shape[1]].index_copy_(0, torch.where(rows, checked_at, self.trash), q)
        return torch.where(rows, drawn, greedy)

    def propose_tokens(self, v, tail, block_tables: torch.Tensor, last_tokens: torch.Tensor) -> None:
        """A token-count step's verifying sequences (decode rows beside prompts: TokenViews v, StepTail tail): their
        drafts into v.ids and tail.draft_ids, in place, before the step's forward runs (eagerly: their count
        varies)."""
        rows = tail.sample_token_rows.long()
        if not rows.shape[0]:
            return
        slots = v.token_slots[rows].long()
        given = v.ids[rows]
        ids = torch.where(given >= 0, given, last_tokens[slots])
        proposing = (tail.group_back == 0) & (tail.draft_ids == DEVICE_DRAFT)
        positions = v.positions[rows]
        filled = self.propose(ids, block_tables[slots], slots.to(torch.int32), positions, v.slot_mapping[rows],
                              positions + 1,
                              given == DEVICE_DRAFT, tail.draft_ids, tail.group_back, proposing)
        v.ids[rows] = filled


__all__ = ["DraftModel"]
