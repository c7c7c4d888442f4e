"""The buffers a step runs over, wired in one place: the KV cache, the persistent per-slot state, the decode and
token forwards over their static inputs, the sampler.

ModelRunner holds one set for its life; the start-up memory probe (runner/startup/memory.py) builds the same set over a
probe-sized cache, measures what the steps and graphs add on top, and drops it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.runner.draft_model import DraftModel
from nanoserve.runner.forward import DecodeForward, TokenForward
from nanoserve.runner.inputs import DecodeInputs, PersistentState, StepPacker, TokenInputs
from nanoserve.runner.kv_cache import KVCacheSpec
from nanoserve.runner.sampler import Sampler
from nanoserve.runner.speculative import DraftState


@dataclass
class StepBuffers:
    kv_cache: torch.Tensor
    dummy_block: int  # the extra block at the end of the cache: padded decode rows write there
    state: PersistentState
    decode_inputs: DecodeInputs
    decode_forward: DecodeForward
    token_forward: TokenForward  # over static TokenInputs when the config has token-count graphs
    sampler: Sampler

    @classmethod
    def build(cls, model, config: EngineConfig, kv: KVCacheSpec, num_kv_blocks: int, device: torch.device,
              rng: torch.Generator | None = None, draft: tuple | None = None) -> "StepBuffers":
        """rng: the sampler's noise for unseeded rows (None: torch's default RNG); draft: (a draft model, its
        KVCacheSpec) when a draft model proposes drafts: its cache gets the same blocks (runner/draft_model.py)."""
        kv_cache = kv.allocate(model, num_kv_blocks, device)
        dummy_block = num_kv_blocks
        dummy_kv_slot = dummy_block * config.block_size
        state = PersistentState(config.max_num_seqs, kv.blocks_for(config.max_model_len), dummy_block, device)
        state.tail_block_size = kv.block_size if kv.tail_slots else None
        spec = config.speculative
        if spec is not None and spec.drafts_on_device:
            state.drafting = DraftState(config.max_num_seqs + 1, config.max_model_len, config.max_num_seqs,
                                        config.block_size, spec.num_speculative_tokens, spec.prompt_lookup_min,
                                        spec.prompt_lookup_max, device, history=draft is None)
        if draft is not None:
            draft_model, draft_kv = draft
            draft_kv.allocate(draft_model, num_kv_blocks, device)  # (its layers hold the views; released with them)
            state.draft_model = DraftModel(draft_model, spec.num_speculative_tokens, config.max_num_seqs,
                                           dummy_kv_slot, model.vocab_size, device)
            state.draft_model.tail_block_size = draft_kv.block_size if draft_kv.tail_slots else None
        decode_inputs = DecodeInputs(config.max_num_seqs, state, dummy_kv_slot, device)
        tokens = config.prefill_graph_sizes.largest
        models = (model,) if draft is None else (model, draft[0])
        q_per_tile = TokenForward.q_per_tile_of(*models)
        token_inputs = TokenInputs(tokens, config.max_num_seqs, q_per_tile, state, dummy_kv_slot,
                                   device) if tokens else None
        token_forward = TokenForward(model, state, StepPacker(device), token_inputs,
                                     logprob_chunk=config.max_num_seqs, q_per_tile=q_per_tile)
        seq_rows = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        decode_forward = DecodeForward(model, state, decode_inputs, seq_rows)
        return cls(kv_cache, dummy_block, state, decode_inputs, decode_forward, token_forward,
                   Sampler(config.max_sampled_rows, device, rng, model.vocab_size))

    def static_bytes(self) -> int:
        """Device bytes of the static buffers besides the KV cache (block tables, the forwards' inputs and outputs)."""
        tensors = [self.state.block_tables, self.decode_inputs.device_buf, self.decode_forward.static_logits]
        if self.state.drafting is not None:
            tensors.append(self.state.drafting.history)
        if self.state.draft_model is not None:
            tensors.append(self.state.draft_model.q)
        if self.token_forward.inputs is not None:
            tensors += [self.token_forward.inputs.device_buf, self.token_forward.static_hidden]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


__all__ = ["StepBuffers"]
