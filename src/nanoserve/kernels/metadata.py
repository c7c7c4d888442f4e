"""AttentionInputs: what the attention kernels read besides q/k/v and the caches, as a structural type.

The kernels are the bottom floor: they import no dataclass from above. The object they get is the model's
nanoserve.model.attention_metadata.AttentionMetadata (which the runner builds); any object with these
attributes will do (the tests check that the dataclass has them all). What each field holds (shapes, dtypes) is
said once, there.
"""
from __future__ import annotations

from typing import Protocol

import torch


class AttentionInputs(Protocol):
    is_prefill: bool
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int
    has_cached_prefix: bool
    query_lens_host: list[int] | None
    context_lens_host: list[int] | None
    work_seq: torch.Tensor | None
    work_start: torch.Tensor | None
    table_rows: torch.Tensor | None
    tail_rows: torch.Tensor | None
    seq_rows: int
    group_back: torch.Tensor | None

    @property
    def num_seqs(self) -> int: ...


__all__ = ["AttentionInputs"]
