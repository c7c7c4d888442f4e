"""EngineCore: the step loop — schedule → run on the device → learn the sampled tokens → per-step deltas.

With async_scheduling (the default) the host schedules and launches step N+1 before it reads step N's tokens, so the
Python around the graph overlaps the device: a step's input ids are the previous step's samples, read on the device.
The host learns tokens one step late: a sequence that step N finished (EOS, a stop id) has already been scheduled in
step N+1; that extra token is discarded and its blocks were freed when step N was read (the device runs the steps in
order, so nothing is reused under it). Lengths are known on the host, so max_tokens never produces an extra token.
Penalties need each row's token history, so while any request uses them the loop waits for each step before the next
(same tokens, no overlap). Speculative decoding keeps the overlap when its drafts come from the device (n-gram: a
step in flight counts its drafts as kept until read; engine/speculation.py), and waits like penalties otherwise.

A structured output's token bitmask needs its sequence's previous token. A step with such rows launches its forward
only, its sampler deferred. With step N+1 so launched, the next call first reads step N, whose tokens arrive as
forward N+1 starts, advances the matchers and starts filling step N+1's masks (engine/grammar.py: on the mask thread
from a few rows on), then, while they fill, schedules and builds step N+2 (the scheduler is then two steps ahead of
these rows' tokens: they count as pending, so lengths, max_tokens, min_tokens and block counts stay exact) and
completes step N's outputs, then launches N+1's sampler and forward N+2, which reads the tokens it writes. So the
mask for step N+1 is ready before its forward ends whenever reading, matching and the fill take less than a forward.
A sequence that step N finishes (EOS, a stop id, its grammar's end) was already scheduled in steps N+1 and N+2: both
tokens are discarded, and its blocks and slot are freed before step N+2 launches, which still writes them. That is
safe because nothing is allocated between that free and that launch, and whatever a later schedule allocates runs on
the device after it. A sequence preempted while building N+2 keeps its pending tokens and rejoins once they are
read.

The loop's state (the steps in flight, the deferred one) is one object, engine/pipeline.py, which checks these rules
as they happen. The core deals in token ids only; text, stop strings and n > 1 fan-out are the front end's
(engine/output.py), in the API process or in-process for the offline LLM.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from nanoserve.config import EngineConfig
from nanoserve.engine.batching import build_batch, distribute_prompt_logprobs
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.grammar import Grammars
from nanoserve.engine.messages import EngineRequest, EngineStats, SeqOutput
from nanoserve.engine.preflight import check_engine_config
from nanoserve.engine.ready_line import ready_line
from nanoserve.engine.pipeline import HostClock, InFlight, StepPipeline
from nanoserve.engine.prompts import check_params_token_ids, check_prompt_ids
from nanoserve.engine.scheduler import ScheduledStep, Scheduler, prompt_token_caps
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.model_files import ModelSpec, eos_token_ids, load_tokenizer
from nanoserve.runner.batch import PrefillBatch, SampledTokens
from nanoserve.runner.parallel.group import WorkerError, create_runner

logger = logging.getLogger("nanoserve")

GRAMMAR_WAIT_S = 0.01  # an idle loop with only grammars compiling waits this long for one, not spinning


class EngineCore:
    def __init__(self, config: EngineConfig, hf_config=None):
        """hf_config: the model's config, when the caller has loaded (and checked) it already."""
        start = time.perf_counter()
        self.config, hf_config = check_engine_config(config, hf_config)
        self.runner = create_runner(self.config, hf_config)  # a RunnerGroup under tensor parallelism
        self.info, self.counters = self.runner.info, self.runner.counters  # all the core reads of the runner
        self.vocab_size = self.info.vocab_size
        self.eos_token_ids = [t for t in self._eos_ids(hf_config) if 0 <= t < self.vocab_size]
        self.block_manager = BlockManager(self.info.num_kv_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching,
                                          ModelSpec.from_hf_config(hf_config).uniform_window)
        self.scheduler = Scheduler(self.config, self.block_manager, prompt_token_caps(self.config, self.info))
        self.sequences: dict[str, Sequence] = {}
        self._pipeline = StepPipeline()
        self._num_penalty_seqs = self._num_grammar_seqs = self._num_min_tokens_seqs = 0
        self._grammars: Grammars | None = None  # made by the first structured-output request
        self._compiling: dict[str, Future] = {}  # request id → its grammar, compiling; the sequence waits for it
        self._prompt_tokens = self._generation_tokens = self._mixed_steps = 0
        self._speculator = self._make_speculator()
        self._host = HostClock()  # the host's own time a step (host drafts' back-off prices it)
        logger.info("%s", ready_line(self.config, self.info, hf_config, self.block_manager.window,
                                      time.perf_counter() - start))

    def _make_speculator(self):
        spec = self.config.speculative
        if spec is None:
            return None
        from nanoserve.engine.speculation import Speculator  # (the proposers load only when asked for)
        return Speculator(spec, self.config.max_model_len, self.config.max_num_seqs, self.info.step_curve,
                          self.info.token_curve, self.info.draft_curve, self.info.verify_curve)

    def _eos_ids(self, hf_config) -> list[int]:
        ids = eos_token_ids(self.config.model, hf_config)
        if not ids and not self.config.skip_tokenizer_init:  # only the tokenizer knows it
            ids = eos_token_ids(self.config.model, hf_config, load_tokenizer(self.config.tokenizer or self.config.model))
        return ids

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue one sequence. Raises ValueError for what the front end should have refused."""
        rid, ids, params = request.request_id, request.prompt_token_ids, request.params
        if rid in self.sequences:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.n != 1:
            raise ValueError(f"the engine core runs single sequences (n=1), got n={params.n}")
        check_prompt_ids(ids, self.vocab_size, self.config.max_model_len)
        check_params_token_ids(params, self.vocab_size)
        so = params.structured_outputs
        grammar = None if so is None else self._grammar_store().compile(so)
        seq = Sequence(rid, list(ids), params)
        seq.generator = params.make_generator(self.info.device)
        self.sequences[rid] = seq
        if self._speculator is not None:
            self._speculator.add(seq)
        if grammar is None:
            self.scheduler.add(seq)
        else:  # scheduled once compiled (_admit_compiled)
            self._compiling[rid] = grammar
        self._num_penalty_seqs += params.uses_penalties
        self._num_min_tokens_seqs += params.min_tokens > 0
        self._prompt_tokens += len(ids)

    def _grammar_store(self) -> Grammars:
        if self._grammars is None:
            if self.config.skip_tokenizer_init:
                raise ValueError("structured outputs need the tokenizer, and this engine runs without one "
                                 "(skip_tokenizer_init)")
            c = self.config
            self._grammars = Grammars(lambda: load_tokenizer(c.tokenizer or c.model), self.vocab_size,
                                      self.eos_token_ids, c.max_sampled_rows, self.info.device.startswith("cuda"))
        return self._grammars

    def _admit_compiled(self) -> list[SeqOutput]:
        """Schedule the sequences whose grammar is ready, each with a matcher of its own; a failed compilation, or one
        past its deadline (Grammars.expire), finishes its sequence with an error."""
        self._grammars.expire()
        outputs = []
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            seq = self.sequences[rid]
            try:
                matcher = self._grammars.matcher(future.result())
            except Exception as e:  # the front ends validate first: this is a grammar xgrammar fails to compile
                del self.sequences[rid]
                self._finish(seq, "error")
                outputs.append(SeqOutput(rid, [], finish_reason="error", error=f"cannot compile the grammar: {e}"))
                continue
            del self._compiling[rid]
            seq.grammar = matcher
            self.scheduler.add(seq)
            self._num_grammar_seqs += 1
        return outputs

    def abort_requests(self, request_ids) -> None:
        """Stop and free these sequences now (unknown or finished ids are ignored); no output follows."""
        for rid in request_ids:
            seq = self.sequences.pop(rid, None)
            if seq is not None:
                self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences) or self._pipeline.busy

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        """Schedule and launch a step; return what the steps read meanwhile (or, synchronously, this one)
        produced. With overlap the step is scheduled and built before the host waits for any token, except that a
        constrained step before it (its forward running) first has the step before that read and its own masks
        started: they fill while this one is scheduled and built; then its sampler and this step are launched."""
        self._host.begin()
        outputs: list[SeqOutput] = self._admit_compiled() if self._compiling else []
        spec = self._speculator
        may_overlap = self.config.async_scheduling and self._num_penalty_seqs == 0
        if spec is not None and not may_overlap:
            spec.loop_waits()
        overlap = may_overlap and (spec is None or self._spec_overlaps())
        if not overlap:  # every token known before scheduling
            outputs += self._read_all()
        started = self._start_deferred() if self._pipeline.deferred is not None else None
        if spec is not None and self._drafts_host(spec) is not None and (spec.on_device or not overlap):
            spec.offer(self.scheduler.running, on_device=overlap)  # (host drafts need every token: not overlapping)
            if self._num_grammar_seqs:
                self._grammars.trim_drafts(self.scheduler.running)
        step = self.scheduler.schedule()
        batch = build_batch(step, self.config.block_size, self.eos_token_ids, self.config.max_num_seqs,
                            *((spec.on_device, spec.spec.samples_drafts) if spec is not None else ())) if step else None
        if started is not None:  # (overlap only) the step before it read, masked and sampled: see the docstring
            outputs += self._sample_deferred(started)
            if step and all(s.is_finished for s in step.seqs):  # every row ended in that read: nothing to run
                step = None
        if step:
            outputs += self._launch(step, batch, overlap)
        elif not len(self._pipeline) and self._compiling:  # nothing to run until a grammar is ready
            wait(self._compiling.values(), GRAMMAR_WAIT_S, FIRST_COMPLETED)
        keep = 1 if step and (overlap or spec is not None) else 0  # speculating: the front end's work overlaps it
        while len(self._pipeline) > keep:
            outputs += self._complete(*self._read(self._pipeline.oldest()))
        if step:
            self._host.end()
        return outputs

    def _spec_overlaps(self) -> bool:
        """Speculating, the next step may be scheduled before the one in flight is read: with device drafts, when it is
        decode rows only (prompt positions, min_tokens bans: the host must know every token); with host drafts, when
        waiting for the step in flight would not pay for itself (Speculator.worth_waiting: then it drafts nothing)."""
        spec = self._speculator
        host = bool(self._drafts_host(spec))
        waits = spec.worth_waiting(self.scheduler.running, self._host.ms, host=host)
        if host:  # (host positions: not past a step whose drafts are not read yet)
            return not waits and not self._pipeline.verifying
        s = self.scheduler
        return not self._num_min_tokens_seqs and not s.waiting and all(seq.decoding for seq in s.running)

    def _drafts_host(self, spec) -> bool | None:
        """Whether drafts come from the host: a host method's, or, while a constrained sequence runs, any with a host
        proposer (masks follow drafts: the host must know them); None: none (a draft model's, beside those)."""
        if not self._num_grammar_seqs:
            return not spec.on_device
        return True if spec.proposer is not None else None

    def _launch(self, step: ScheduledStep, batch, overlap: bool) -> list[SeqOutput]:
        """Launch a built step: whole, or (grammar rows still running) its forward only, its sampler deferred."""
        self._mixed_steps += isinstance(batch, PrefillBatch)
        sampled = [s for s, samples in zip(step.seqs, step.samples) if samples]
        if self._num_grammar_seqs and any(s.grammar is not None for s in sampled):
            pending = self.runner.execute(batch, defer_sampling=True)  # its sampler waits for the masks
            self._pipeline.defer(InFlight(step, sampled), batch.sampling, pending)
            return [] if overlap else self._sample_deferred()
        self._pipeline.launched(InFlight(step, sampled, self.runner.execute(batch)))
        return []

    def _read_all(self) -> list[SeqOutput]:
        """Launch the deferred sampler, if any, and read every step in flight."""
        outputs = self._sample_deferred() if self._pipeline.deferred is not None else []
        while len(self._pipeline):
            outputs += self._complete(*self._read(self._pipeline.oldest()))
        return outputs

    def _start_deferred(self):
        """Read the steps before the deferred one (their tokens advance the matchers; the device runs the deferred
        forward meanwhile) and start filling its masks (engine/grammar.py: on a thread from a few rows on). Rows whose
        grammar ended or refused a token in those reads are left unmasked: they end, their token is discarded."""
        reads = [self._read(done) for done in self._pipeline.take_all()]
        ending = {id(done.sampled[i]) for done, result, accepted in reads if accepted is not None
                  for i, ok in enumerate(accepted) if not ok or self._grammars.ends(result.token_ids[i])}
        launched = self._pipeline.deferred.launched
        rows = [None if id(s) in ending else s.grammar for s in launched.sampled]
        return reads, self._grammars.start_fill(rows, launched.step.sampled_drafts)

    def _sample_deferred(self, started=None) -> list[SeqOutput]:
        """Launch the sampler of the step whose forward runs, once its masks are filled (started: _start_deferred's
        reads and fill; None: start them now). It comes before any later step's forward, which reads the tokens it
        samples. Returns the outputs of the steps read."""
        reads, fill = started if started is not None else self._start_deferred()
        outputs = []
        for read in reads:  # (the mask fill runs meanwhile)
            outputs += self._complete(*read)
        deferred = self._pipeline.take_deferred()
        sampling = deferred.sampling
        if fill is not None:
            rows, bitmask = fill.result()
            sampling = dataclasses.replace(sampling, grammar_rows=rows, grammar_bitmask=bitmask)
        self._pipeline.sampler_launched(deferred, self.runner.sample_deferred(deferred.pending, sampling))
        return outputs

    def _read(self, done: InFlight) -> tuple[InFlight, SampledTokens | None, list[bool] | None]:
        """Wait for a step's sampled tokens and advance its rows' matchers by them: the step, its tokens, and per row
        whether the token fitted its grammar (None without grammar rows)."""
        if done.handle is None:
            return done, None, None
        with self._host.waiting():
            if self._speculator is not None:  # (a host proposer's deferred indexing runs meanwhile)
                self._speculator.idle(done.handle.ready)
            result = done.handle.result()
        grammar = self._num_grammar_seqs and not done.step.has_drafts
        accepted = self._grammars.accept(done.sampled, result.token_ids) if grammar else None
        return done, result, accepted

    def _complete(self, done: InFlight, result: SampledTokens | None, accepted: list[bool] | None) -> list[SeqOutput]:
        """Append a read step's tokens, register full blocks, finish; the deltas of live sequences."""
        if result is None:
            return []
        if result.prompt_logprobs is not None:
            distribute_prompt_logprobs(done.step, result.prompt_logprobs)
        outputs, row = [], 0
        for i, (seq, seq_drafts) in enumerate(zip(done.sampled, done.step.sampled_drafts)):
            rows = range(row, row + 1 + len(seq_drafts))  # its sampled rows: one, or one per draft and one more
            row = rows.stop
            seq.num_pending -= len(rows)
            if seq.is_finished:  # finished or aborted after this step was launched: the token is discarded
                continue
            if accepted is not None and not accepted[i]:
                outputs.append(self._grammar_dead_end(seq, result.token_ids[rows.start]))
                continue
            if seq_drafts:  # (the device's drafts: the host knows only how many were offered, when drafted there)
                drafts = result.draft_ids[rows.start:rows.stop - 1]
                tokens = self._speculator.verified(seq, drafts, result.token_ids[rows.start:rows.stop])
                rows = rows[:len(tokens)]
            if accepted is None and seq.grammar is not None:  # (a verifying step's: its matchers advance here)
                fit = self._grammars.accept_run(seq.grammar, [result.token_ids[r] for r in rows])
                if fit < len(rows):
                    outputs.append(self._grammar_dead_end(seq, result.token_ids[rows[fit]], rows[:fit], result))
                    continue
            outputs.append(self._append_tokens(seq, rows, result))
        return outputs

    def _append_tokens(self, seq: Sequence, rows: range, result: SampledTokens) -> SeqOutput:
        """Append the samples of these rows to seq, up to the one that ends it; its delta."""
        out = SeqOutput(seq.request_id, [])
        if result.logprobs is not None:
            out.token_logprobs, out.top_logprobs = [], []
        for r in rows:
            token = result.token_ids[r]
            seq.output_token_ids.append(token)
            out.new_token_ids.append(token)
            self._generation_tokens += 1
            self.block_manager.register_full_blocks(seq, seq.num_computed_tokens)
            if result.logprobs is not None:
                out.token_logprobs.append(result.logprobs[r])
                out.top_logprobs.append(result.top_logprobs[r])
            if len(seq.output_token_ids) == 1:
                out.num_cached_tokens = seq.num_cached_tokens
                if seq.params.prompt_logprobs is not None:
                    out.prompt_logprobs = seq.prompt_logprobs
            reason = self._finish_reason(seq, token)
            if reason is not None:
                out.finish_reason, out.stop_reason = reason, seq.stop_reason
                self.sequences.pop(seq.request_id, None)
                self._finish(seq, reason)
                return out
        if self._speculator is not None:
            self._speculator.extend(seq, out.new_token_ids)
        return out

    def _grammar_dead_end(self, seq: Sequence, token: int, fits: range = range(0), result=None) -> SeqOutput:
        """The grammar allowed no token the sampler could take (min_tokens banned the stop tokens the grammar
        ended with): the sequence ends where its grammar did (after the rows `fits` of result), without the token."""
        logger.warning("request %s: token %d does not fit its grammar (min_tokens=%d outlasts it); it ends here",
                       seq.request_id, token, seq.params.min_tokens)
        out = self._append_tokens(seq, fits, result) if fits else SeqOutput(seq.request_id, [])
        if not seq.is_finished:
            self.sequences.pop(seq.request_id, None)
            self._finish(seq, "stop")
            out.finish_reason = "stop"
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and self._grammars.ends(token):  # the grammar is complete: nothing may follow
            return "stop"
        if p.reached_min_tokens(len(seq.output_token_ids)):  # (earlier tokens could not be stop tokens: banned)
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop"
        if seq.reached_length_limit(self.config.max_model_len, pending=False):
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        if self._compiling.pop(seq.request_id, None) is not None:  # never scheduled: its grammar was compiling
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)
        if self._speculator is not None:  # a finished request's output feeds the suffix proposer's cache
            self._speculator.remove(seq, keep_outputs=reason not in ("abort", "error"))
        self._num_penalty_seqs -= seq.params.uses_penalties
        self._num_min_tokens_seqs -= seq.params.min_tokens > 0
        if seq.grammar is not None:
            self._num_grammar_seqs -= 1
            seq.grammar = None

    def close(self) -> None:
        """Finish what is in flight, write the batch histogram (cudagraph_plan), drop the device state."""
        try:
            self._read_all()
        except WorkerError:  # a tensor-parallel rank died: what was in flight died with it
            self._pipeline.clear()
        self.abort_requests(list(self.sequences))
        if self._grammars is not None:
            self._grammars.close()
        if self.runner is not None:
            self.runner.save_batch_histogram()
            self.runner.close()
            self.runner = None

    # -- observability ----------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),  # (a grammar compiling: waiting too)
            kv_blocks_total=self.block_manager.num_blocks, kv_blocks_used=self.block_manager.num_used_blocks,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            mixed_steps=self._mixed_steps, preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            kv_cache_dtype=self.info.kv_cache_dtype, kv_cache_scales=self.info.kv_cache_scales,
            kv_block_bytes=self.info.kv_block_bytes,
            **self._host.totals(), **(self._speculator.stats() if self._speculator is not None else {}),
            **vars(self.counters))  # the runner's steps by how they ran, its padding (RunnerCounters)
