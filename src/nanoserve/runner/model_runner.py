"""ModelRunner: runs one step's batch on the device and samples it, without waiting for the result.

Start-up reads top-down: load the model → plan memory → allocate the KV cache and the persistent
per-slot state → capture the decode graphs, then the token-count graphs. A step: decode batches replay the
smallest captured bucket that fits (or run the same forward eagerly: above the largest bucket, enforce_eager,
no CUDA); prefill batches (prompt chunks, decode rows riding along) replay the smallest token-count graph of
at least their tokens, or run eagerly at their own size (over the largest, or too many block updates).
Either way the sampler writes the sampled ids into the slots' last-token cells on the device and starts
their copy to the host; the returned SampleHandle is read by the engine one step later.

Under tensor parallelism (tp: this rank's place in the group) every rank builds its own runner over its
shards and makes the same calls in the same order (runner/group.py): the ranks agree on the smallest KV
block count, rank 0 plans the "auto" graph sizes for all, and every random draw (probe inputs, unseeded
sampling) comes from the runner's own generators, seeded alike on every rank, so all ranks sample the same
tokens whatever else their process does with torch's default RNG.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.kernels.paging import kv_slots
from nanoserve.model.loader import load_model
from nanoserve.model.communicator import TensorParallel
from nanoserve.runner import graph_setup
from nanoserve.runner.batch import BlockUpdates, DecodeBatch, PrefillBatch, SamplingBatch, disjoint_decode_batch
from nanoserve.runner.bucket_plan import BatchDistribution
from nanoserve.runner.buffers import StepBuffers
from nanoserve.runner.cuda_graph import GraphRunner
from nanoserve.runner.kv_cache import KVCacheSpec
from nanoserve.runner.memory import plan_memory
from nanoserve.runner.sampler import SampleHandle, SamplingTensors

logger = logging.getLogger("nanoserve")

PROBE_CONTEXT = 512  # tokens per row in the start-up probes and self-check


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, tp: TensorParallel | None = None):
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.tp = tp or TensorParallel(device=self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.rng = torch.Generator(device=self.device).manual_seed(config.seed)  # probes and unseeded sampling
        self.host_rng = torch.Generator().manual_seed(config.seed)  # self-check context lengths
        self.model = load_model(config.model, hf_config, self.dtype, self.device, config.load_format, self.tp,
                                quantization=config.quantization, quantize_lm_head=config.quantize_lm_head,
                                progress=config.show_progress and self.tp.rank == 0)
        self.vocab_size = self.model.vocab_size
        self.kv = KVCacheSpec.of(self.model, config.block_size, self.dtype)
        self.max_blocks_per_seq = self.kv.blocks_for(config.max_model_len)
        self.memory_plan = plan_memory(self.model, config, self.kv)
        self.num_kv_blocks = self.tp.min_int(self.memory_plan.num_kv_blocks)  # every rank's cache holds it
        if self.num_kv_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks * config.block_size} tokens ({self.num_kv_blocks} blocks), "
                f"fewer than max_model_len={config.max_model_len}; lower max_model_len or give the cache more memory")
        self._allocate()
        self._warm_up_logits()
        self.decode_steps_graph = self.decode_steps_eager = self.padding_rows = 0
        self.prefill_steps_graph = self.prefill_steps_eager = self.padding_tokens = 0
        self.graph_runner: GraphRunner | None = None
        self.token_graphs: GraphRunner | None = None
        self.step_curve = self.token_curve = None
        self.batch_histogram = BatchDistribution.empty(config.max_num_seqs)
        if config.cudagraph_capture_sizes:
            self._capture()
        if config.prefill_graph_sizes:
            self._capture_tokens()
        if not config.cudagraph_capture_sizes:
            why = "enforce_eager" if config.enforce_eager else "no CUDA device"
            logger.info("decode runs eagerly (%s); %d KV blocks of %d tokens", why, self.num_kv_blocks,
                        config.block_size)

    def _allocate(self) -> None:
        b = StepBuffers.build(self.model, self.config, self.kv, self.num_kv_blocks, self.device, self.rng)
        self.kv_cache, self.dummy_block, self.state = b.kv_cache, b.dummy_block, b.state
        self.decode_inputs, self.decode_forward, self.token_forward = b.decode_inputs, b.decode_forward, b.token_forward
        self.sampler = b.sampler
        self._deferred = None  # execute(defer_sampling=True): _sample's arguments after the sampling batch

    @torch.inference_mode()
    def _warm_up_logits(self) -> None:
        """Compile the lm_head product for every row bucket a step may sample (prefill steps sample any count)."""
        if self.device.type != "cuda":
            return
        rows = 1
        while rows <= min(self.config.max_num_seqs, 64) * 2:
            self.model.compute_logits(torch.zeros(rows, self.model.hidden_size, dtype=self.dtype, device=self.device))
            rows *= 2
        torch.cuda.synchronize()

    def _capture(self) -> None:
        """Plan (for "auto"), capture, self-check; one log line."""
        cfg = self.config
        gr = GraphRunner(self.decode_forward.captured, self.decode_forward.prepare_padding)
        sizes, probe_seconds = list(cfg.cudagraph_capture_sizes.sizes), 0.0
        if cfg.cudagraph_capture_sizes.planned:
            probes = graph_setup.probe_sizes(cfg.max_num_seqs)
            curve = graph_setup.measure_curve(gr, self._load_probe_batch, probes)
            share = 0.5 if cfg.prefill_graph_sizes.planned else 1.0  # the token-count graphs plan in the rest
            budget_s, pool = share * cfg.cudagraph_capture_budget_s, share * cfg.cudagraph_pool_budget_mib * 2**20
            planned = graph_setup.plan(curve, cfg.max_num_seqs, cfg.cudagraph_plan, budget_s, pool) \
                if self.tp.rank == 0 else []
            sizes = self.tp.broadcast_ints(planned, cfg.max_num_seqs)  # every rank captures rank 0's plan
            probe_seconds = sum(gr.capture_times.values())
            gr.drop(set(probes) - set(sizes))
            self.step_curve = curve
        gr.capture(sizes, cfg.show_progress)
        self.graph_runner = gr
        sampler_seconds = self.sampler.capture_plain(
            gr.capture_sizes, self.decode_forward.static_logits, self._sample_inputs, self.state.last_tokens,
            self.decode_forward.prepare_padding, gr.pool) if self.sampler.fuses else 0.0
        check = "skipped"
        if not cfg.skip_graph_check:
            worst = graph_setup.self_check(gr.capture_sizes, self._decode_check_pair, self.dtype, self.tp.max_float)
            check = f"every size equals eager (max relative logit error {worst:.1e})"
        logger.info("CUDA graphs: %d sizes %s (%s); capture %.2f s (%.2f s with probes and compilation; the "
                    "sampler's %.2f s); pool %.0f MiB; %d KV blocks; self-check: %s", len(gr.capture_sizes),
                    gr.capture_sizes, "planned from measured replays" if probe_seconds else "as configured",
                    gr.capture_seconds, gr.wall_seconds, sampler_seconds, gr.pool_bytes / 2**20, self.num_kv_blocks,
                    check)

    def _capture_tokens(self) -> None:
        """Token-count graphs of prompt / mixed steps into the decode graphs' pool: plan ("auto"), capture, check."""
        cfg, fwd = self.config, self.token_forward
        pool = self.graph_runner.pool if self.graph_runner is not None else None
        gr = GraphRunner(fwd.captured, fwd.prepare_padding, pool=pool, record=self.device.type == "cuda")
        sizes, largest = list(cfg.prefill_graph_sizes.sizes), cfg.prefill_graph_sizes.largest
        load = lambda tokens: fwd.load(self._token_probe_batch(tokens), tokens)  # noqa: E731
        if cfg.prefill_graph_sizes.planned:
            probes = graph_setup.token_probe_sizes(largest)
            self.token_curve = graph_setup.measure_curve(gr, load, probes)
            spent = self.graph_runner.capture_seconds if self.graph_runner is not None else 0.0
            pool_used = self.graph_runner.pool_bytes if self.graph_runner is not None else 0
            planned = graph_setup.plan_tokens(self.token_curve, largest,
                                              cfg.cudagraph_capture_budget_s - spent,
                                              cfg.cudagraph_pool_budget_mib * 2**20 - pool_used)
            sizes = self.tp.broadcast_ints(planned if self.tp.rank == 0 else [], largest)
            gr.drop(set(probes) - set(sizes))
        gr.capture(sizes, cfg.show_progress)
        self.token_graphs = gr
        check = "skipped"
        if not cfg.skip_graph_check:
            worst = graph_setup.self_check(gr.capture_sizes, self._token_check_pair, self.dtype, self.tp.max_float,
                                           "CUDA graph of {} tokens (a mixed step)")
            check = f"every size equals eager on a mixed step (max relative logit error {worst:.1e})"
        logger.info("CUDA graphs for prompt / mixed steps: %d token counts %s; capture %.2f s; pool %.0f MiB in all; "
                    "self-check: %s", len(gr.capture_sizes), gr.capture_sizes, gr.capture_seconds,
                    (gr.pool_bytes + (self.graph_runner.pool_bytes if self.graph_runner else 0)) / 2**20, check)

    def _sample_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode bucket's sampling temperatures and slots (what its sampler graph reads)."""
        v = self.decode_inputs.views(rows)
        return v.sampling.temperature, v.slots

    def _token_probe_batch(self, tokens: int) -> PrefillBatch:
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
        blocks = [self.kv.blocks_for(s + n) for s, n in specs]
        slots = np.arange(len(specs), dtype=np.int32)
        tables = np.full((len(specs), max(blocks)), self.dummy_block, np.int32)
        first = np.cumsum([0] + blocks)
        for i, n in enumerate(blocks):
            tables[i, :n] = np.arange(first[i], first[i + 1])
        self.state.write_tables(slots, tables)
        self.state.last_tokens[:len(specs)].random_(0, self.vocab_size, generator=self.rng)
        bs, token_ids, slot_mapping = self.config.block_size, [], []
        for i, (start, n) in enumerate(specs):
            slot_mapping.append(kv_slots(tables[i], np.arange(start, start + n), bs))
            token_ids.append(np.full(1, -1) if n == 1 else torch.randint(0, self.vocab_size, (n,),
                                                                         generator=self.host_rng).numpy())
        starts, lens = (np.array(x, np.int32) for x in zip(*specs))
        return PrefillBatch(slots, starts, lens, np.concatenate(token_ids).astype(np.int32),
                            np.concatenate(slot_mapping).astype(np.int32), BlockUpdates(), slots, None, tables.shape[1])

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

    def _token_check_pair(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._token_probe_batch(tokens)
        tail = self.token_forward.load(batch, tokens)
        graph = self.token_forward.sample_logits(self.token_graphs.replay(tokens), tail, batch)[0].float().clone()
        return graph, self.token_forward(batch)[0].float()

    def _decode_check_pair(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._load_check_batch(rows)
        return self.graph_runner.replay(rows).float().clone(), self.decode_forward(rows).float()

    def _load_probe_batch(self, rows: int, context: int | None = None) -> None:
        """A decode batch of `rows` real rows over disjoint blocks, with fresh random input tokens (start-up probes
        and the self-check; no request is running yet)."""
        per_row = self.num_kv_blocks // max(self.config.max_num_seqs, 1)
        longest = max(1, min(PROBE_CONTEXT, per_row * self.config.block_size, self.config.max_model_len))
        batch, tables = disjoint_decode_batch(rows, min(context or longest, longest), self.config.block_size,
                                              self.num_kv_blocks)
        self.state.write_tables(batch.slots, tables)
        self.state.last_tokens[:rows].random_(0, self.vocab_size, generator=self.rng)
        self.decode_inputs.load(batch, rows)

    def _load_check_batch(self, rows: int) -> None:
        """Like the probe batch, at a random context length: no two checks see the same inputs."""
        self._load_probe_batch(rows, int(torch.randint(1, PROBE_CONTEXT + 1, (), generator=self.host_rng).item()))

    def close(self) -> None:
        """Drop the graphs and the KV cache; their memory is freed with the last reference."""
        self.graph_runner = self.token_graphs = None
        KVCacheSpec.release(self.model)
        self.kv_cache = None

    def save_batch_histogram(self) -> None:
        """Write the decode batch sizes seen (cudagraph_plan), for the next start-up's plan."""
        if self.config.cudagraph_plan is not None and self.batch_histogram.counts.sum() > 0:
            self.batch_histogram.save(self.config.cudagraph_plan)

    # -- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: DecodeBatch | PrefillBatch, defer_sampling: bool = False) -> SampleHandle | None:
        """Launch the step and its sampling; None when the batch samples nothing (a mid-prompt chunk).
        defer_sampling: launch the forward only and keep its logits; sample_deferred() launches the sampler (the
        engine fills the grammar bitmask in between). Nothing else may run on this runner before it."""
        prompt = bucket = None
        if isinstance(batch, PrefillBatch):
            logits, params, slots, prompt = self._prefill(batch)
        else:
            logits, rows, bucket = self._decode(batch)
            views = self.decode_inputs.views(rows)
            b = batch.size
            s = views.sampling
            params = SamplingTensors(s.temperature[:b], s.top_p[:b], s.top_k[:b], s.min_p[:b])
            slots = views.slots[:b]
        if batch.sampling is None or not len(batch.sampling):
            return None if prompt is None else SampleHandle.empty(prompt)
        if defer_sampling:
            self._deferred = (logits, params, slots, prompt, bucket)
            return None
        return self._sample(batch.sampling, logits, params, slots, prompt, bucket)

    @torch.inference_mode()
    def sample_deferred(self, sampling: SamplingBatch) -> SampleHandle:
        """Launch the sampler of the step execute(defer_sampling=True) ran, with this (now complete) SamplingBatch."""
        deferred, self._deferred = self._deferred, None
        return self._sample(sampling, *deferred)

    def _sample(self, sampling: SamplingBatch, logits, params, slots, prompt, bucket: int | None) -> SampleHandle:
        """bucket: the decode graph that made the logits (a plain batch replays that bucket's sampler graph)."""
        handle = self.sampler(logits, sampling, params, self.state.last_tokens, slots, bucket)
        handle.prompt_logprobs = prompt
        return handle

    def _prefill(self, batch: PrefillBatch):
        """A prompt / mixed step: the smallest token-count graph of at least its tokens, or eagerly."""
        gr, n = self.token_graphs, batch.num_tokens
        tokens = gr.bucket_for(n) if gr is not None else None
        tail = self.token_forward.load(batch, tokens) if tokens is not None else None
        if tail is None:
            self.prefill_steps_eager += 1
            return self.token_forward(batch)
        self.prefill_steps_graph += 1
        self.padding_tokens += tokens - n
        return self.token_forward.sample_logits(gr.replay(tokens), tail, batch)

    def _decode(self, batch: DecodeBatch) -> tuple[torch.Tensor, int, int | None]:
        """Logits [b, vocab] of a decode batch, the rows the step ran (its bucket, or b when eager) and the bucket
        whose graph it replayed (None when eager)."""
        b = batch.size
        self.batch_histogram.record(b)
        gr = self.graph_runner
        rows = gr.bucket_for(b) if gr is not None else None
        if rows is not None:
            self.decode_steps_graph += 1
            self.padding_rows += rows - b
            self.decode_inputs.load(batch, rows)
            return gr.replay(rows)[:b], rows, rows
        self.decode_steps_eager += 1
        if b > self.decode_inputs.max_rows:
            raise ValueError(f"decode batch of {b} exceeds max_num_seqs={self.config.max_num_seqs}")
        self.decode_inputs.load(batch, b)
        width = self.kv.blocks_for(int(batch.context_lens.max())) if b else 1  # read only the blocks in use
        return self.decode_forward(b, width), b, None
