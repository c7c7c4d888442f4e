"""ModelRunner: turns scheduled sequences into tensors and logits.

Owns the model, the paged KV cache and the decode path: prefill runs eagerly (variable length);
decode replays a CUDA graph when one fits (GraphRunner) and otherwise runs the same forward
eagerly — above the largest bucket, with enforce_eager, or without CUDA.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.metadata import AttentionMetadata
from nanoserve.model.loader import load_model
from nanoserve.runner.cuda_graph import DecodeBatch, GraphRunner, StaticDecodeInputs

logger = logging.getLogger("nanoserve")


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config):
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = cdiv(config.max_model_len, config.block_size)
        if self.device.type == "cuda":  # pin an index: graphs, pools and streams belong to one device
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.model = load_model(config.model, hf_config, self.dtype, self.device, config.load_format)
        self.vocab_size = self.model.vocab_size
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.num_kv_blocks = self._plan_kv_blocks()
        if self.num_kv_blocks * self.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks * self.block_size} tokens ({self.num_kv_blocks} blocks), "
                f"fewer than max_model_len={config.max_model_len}; lower max_model_len or give the cache more memory"
            )
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self.dummy_block = self.num_kv_blocks  # the extra block at the end: padded decode rows write here
        self.decode_inputs = StaticDecodeInputs(config.max_num_seqs, self.max_blocks_per_seq, self.dummy_block,
                                                self.block_size, self.device)
        self.graph_runner: GraphRunner | None = None
        self.decode_steps_graph = self.decode_steps_eager = self.padding_rows = 0
        if self.use_graphs:
            self.graph_runner = self._make_graph_runner(config.capture_sizes())
            self.graph_runner.capture(config.show_progress)
            gr = self.graph_runner
            logger.info("captured %d CUDA graphs (batch sizes %s) in %.2f s; graph pool %.1f MiB; %d KV blocks",
                        len(gr.graphs), gr.capture_sizes, gr.capture_seconds, gr.pool_bytes / 2**20,
                        self.num_kv_blocks)
        else:
            why = "enforce_eager" if config.enforce_eager else "no CUDA device"
            logger.info("decode runs eagerly (%s); %d KV blocks of %d tokens", why, self.num_kv_blocks, self.block_size)

    # -- KV cache and memory plan --------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        m = self.model
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One tensor [2, layers, num_blocks + 1, block_size, kv_heads, head_dim]; layers get views of it."""
        m = self.model
        cache = torch.zeros(2, m.num_layers, num_blocks + 1, self.block_size, m.num_kv_heads, m.head_dim,
                            dtype=self.dtype, device=self.device)
        for i, attn in enumerate(m.attention_layers()):
            attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]
        return cache

    def _plan_kv_blocks(self) -> int:
        """Blocks that fit: explicit, or what is left under gpu_memory_utilization after weights,
        peak prefill activations and the graph pool (measured before the cache is sized)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":  # cpu_kv_cache_gb, but no more than max_num_seqs full-length sequences use
            most_needed = self.config.max_num_seqs * self.max_blocks_per_seq
            return max(min(int(self.config.cpu_kv_cache_gb * 2**30) // self.block_bytes, most_needed), 1)
        activation_peak, graph_bytes = self._profile_memory()
        free, total = torch.cuda.mem_get_info()
        in_use = total - free  # weights, CUDA context, allocator cache
        budget = total * self.config.gpu_memory_utilization - in_use - activation_peak - graph_bytes
        num_blocks = int(budget // self.block_bytes)
        if num_blocks <= 0:
            raise ValueError(
                f"no memory left for the KV cache: {total / 2**30:.1f} GiB × gpu_memory_utilization "
                f"{self.config.gpu_memory_utilization} minus weights/activations/graphs is {budget / 2**30:.2f} GiB"
            )
        logger.info("memory plan: prefill peak %.0f MiB, graph pool %.0f MiB, KV cache %.0f MiB (%d blocks)",
                    activation_peak / 2**20, graph_bytes / 2**20, num_blocks * self.block_bytes / 2**20, num_blocks)
        return num_blocks

    @torch.inference_mode()
    def _profile_memory(self) -> tuple[int, int]:
        """Peak extra memory of a max-size eager prefill, and of one dummy capture of the largest graph."""
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs), 1)
        blocks_per_seq = cdiv(seq_len, self.block_size)
        temp_cache = self._allocate_kv_cache(num_seqs * blocks_per_seq)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seqs = [list(range(blocks_per_seq * i, blocks_per_seq * (i + 1))) for i in range(num_seqs)]
        input_ids, positions, meta, last = self._prefill_tensors(
            [[0] * seq_len] * num_seqs, [0] * num_seqs, seqs)
        self.model.compute_logits(self.model(input_ids, positions, meta)[last])
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - base
        del input_ids, positions, meta, last
        graph_bytes = 0
        if self.use_graphs:
            sizes = self.config.capture_sizes()
            self.dummy_block = num_seqs * blocks_per_seq
            self.decode_inputs = StaticDecodeInputs(cfg.max_num_seqs, self.max_blocks_per_seq, self.dummy_block,
                                                    self.block_size, self.device)
            probe = self._make_graph_runner([sizes[-1]])
            probe.capture(show_progress=False)
            graph_bytes = probe.pool_bytes + probe.logits.numel() * probe.logits.element_size() \
                + self.decode_inputs.device_buf.numel() * 4
            del probe
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        del temp_cache
        self.decode_inputs = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return activation_peak, graph_bytes

    def _make_graph_runner(self, sizes: list[int]) -> GraphRunner:
        return GraphRunner(self.model, self.decode_inputs, sizes, self.vocab_size, self.dtype, self.device)

    # -- prefill ---------------------------------------------------------------------------------
    def _prefill_tensors(self, token_lists: list[list[int]], cached: list[int], block_tables: list[list[int]]):
        """Inputs for prefilling each token list from position cached[i] on; returns (ids, positions, meta, last rows)."""
        bs = self.block_size
        ids, pos, slots, q_lens, ctx_lens = [], [], [], [], []
        for tokens, start, table in zip(token_lists, cached, block_tables):
            n = len(tokens)
            p = np.arange(start, n)
            ids.extend(tokens[start:])
            pos.append(p)
            slots.append(np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs)
            q_lens.append(n - start)
            ctx_lens.append(n)
        width = max(len(t) for t in block_tables)
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(ctx_lens)]).astype(np.int32)
        dev = self.device
        to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=to(np.concatenate(slots), torch.int64),
            context_lens=to(np.asarray(ctx_lens), torch.int32),
            block_tables=to(tables, torch.int32),
            cu_seqlens_q=to(cu_q, torch.int32),
            cu_seqlens_k=to(cu_k, torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(ctx_lens),
            has_cached_prefix=any(c > 0 for c in cached),
            query_lens_host=q_lens,
            context_lens_host=ctx_lens,
        )
        last = to(cu_q[1:] - 1, torch.int64)
        return to(np.asarray(ids), torch.int64), to(np.concatenate(pos), torch.int64), meta, last

    @torch.inference_mode()
    def prefill_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        input_ids, positions, meta, last = self._prefill_tensors(
            [s.token_ids for s in seqs], [s.num_cached_tokens for s in seqs], [s.block_table for s in seqs])
        hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[last])

    # -- decode ----------------------------------------------------------------------------------
    def prepare_decode(self, seqs: list[Sequence]) -> DecodeBatch:
        bs = self.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        positions = lens - 1
        slots = tables[np.arange(len(seqs)), positions // bs] * bs + positions % bs
        ids = np.fromiter((s.last_token_id for s in seqs), dtype=np.int32, count=len(seqs))
        return DecodeBatch(ids, positions, slots, lens, tables)

    def dummy_decode_batch(self, batch_size: int, context_len: int) -> DecodeBatch:
        """A decode batch over disjoint real blocks (for benchmarks and tests); contents are whatever the cache holds."""
        per_seq = cdiv(context_len, self.block_size)
        if batch_size * per_seq > self.num_kv_blocks:
            raise ValueError(f"{batch_size} × {context_len} tokens do not fit in {self.num_kv_blocks} KV blocks")
        tables = np.arange(batch_size * per_seq, dtype=np.int32).reshape(batch_size, per_seq)
        position = context_len - 1
        slots = tables[:, position // self.block_size] * self.block_size + position % self.block_size
        full = lambda v: np.full(batch_size, v, dtype=np.int32)  # noqa: E731
        return DecodeBatch(full(1), full(position), slots.astype(np.int32), full(context_len), tables)

    @torch.inference_mode()
    def decode_logits(self, batch: DecodeBatch, use_graph: bool = True) -> torch.Tensor:
        """Logits [b, vocab]: graph replay of the smallest bucket ≥ b, or the same forward eagerly."""
        b = batch.size
        gr = self.graph_runner
        if use_graph and gr is not None and gr.bucket_for(b) is not None:
            self.decode_steps_graph += 1
            self.padding_rows += gr.bucket_for(b) - b
            return gr.replay(batch)
        self.decode_steps_eager += 1
        if b <= self.decode_inputs.max_rows:
            self.decode_inputs.load(batch, b)
            input_ids, positions, meta = self.decode_inputs.views(b)
        else:  # pragma: no cover - max_num_seqs bounds the batch
            raise ValueError(f"decode batch of {b} exceeds max_num_seqs={self.config.max_num_seqs}")
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    def execute(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        if is_prefill:
            return self.prefill_logits(seqs)
        return self.decode_logits(self.prepare_decode(seqs))
