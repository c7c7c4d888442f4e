"""AttentionMetadata: the contract between the runner and the model, everything attention needs besides q/k/v.

The runner builds one per forward (runner/forward.py) and the model passes it down to its attention layers;
the kernels read it as a kernels.metadata.AttentionInputs (they import nothing from here). Decode metadata has
fixed shapes ([num_seqs] and [num_seqs, max_blocks]) so a CUDA graph can be captured over static buffers of
it: the fields are views of the runner's persistent input buffers, never copies. Prefill metadata varies in
length and is built eagerly (or over the token-count graphs' static buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_new_tokens] int32: block_id * block_size + offset of each new token
    context_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache per sequence once this step's are stored
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: cache blocks of each sequence, padded
    # Prefill only. The new tokens of sequence i are q rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; they are the
    # last (context_len - cached_len) positions of a context of context_len tokens.
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_seqlen_q: int = 0
    has_cached_prefix: bool = False  # True → some keys come only from the paged cache (prefix-cache hits)
    query_lens_host: list[int] | None = None  # host copies so the CPU reference needs no device→host sync
    context_lens_host: list[int] | None = None
    # The paged prefill kernel's work list (kernels.attention.prefill_work): per tile its sequence (-1: unused
    # entry of a fixed-size list) and first query token; None → built from the host lengths.
    work_seq: torch.Tensor | None = None  # [num_tiles] int32
    work_start: torch.Tensor | None = None  # [num_tiles] int32
    table_rows: torch.Tensor | None = None  # [num_seqs] int32: block_tables row of sequence i (None: row i)
    # An fp8 cache's tail (kernels/kv_quant.py): per new token its tail row (-1: none), and table_rows then holds
    # each sequence's slot in decode steps too (decode block tables are gathered per row).
    tail_rows: torch.Tensor | None = None  # [num_new_tokens] int32
    # Decode: at most this many consecutive rows are one sequence's (a verification's last token and its drafts),
    # group_back of them before each row; the attention kernel reads each such group's keys once
    # (kernels.attention.decode_attention). seq_rows > 1 needs group_back.
    seq_rows: int = 1
    group_back: torch.Tensor | None = None  # [num_seqs] int32

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


__all__ = ["AttentionMetadata"]
