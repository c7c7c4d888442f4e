"""LLMEngine.step(): schedule → run the model → sample → append tokens, detokenize, finish.

Requests enter with add_request() and leave when finished or aborted; every step returns the
cumulative state of the requests that changed. One request with n > 1 is n sequences.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nanoserve.config import EngineConfig, hf_config_dtype
from nanoserve.engine import detokenizer
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.model.loader import eos_token_ids, load_hf_config, load_tokenizer, model_max_len
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.sampling import Sampler, SamplingParams

logger = logging.getLogger("nanoserve")


class QueueFullError(RuntimeError):
    """Too many requests are already waiting (the server answers 503)."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    # n == 1 conveniences
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_steps_graph: int = 0
    decode_steps_eager: int = 0
    padding_rows: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0


@dataclass
class _Request:
    prompt: str | None
    stream: bool  # report every step (False: only when finished, and detokenize once at the end if possible)
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        hf_config = load_hf_config(config.model)
        config.resolve(model_max_len(hf_config), hf_config_dtype(hf_config))
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = eos_token_ids(config.model, hf_config, self.tokenizer)
        self.model_runner = ModelRunner(config, hf_config)
        self.vocab_size = self.model_runner.vocab_size
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self._prompt_tokens = self._generation_tokens = self._prefix_hits = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    stream: bool = True) -> None:
        """Queue a request. stream=False: step() reports it only once finished, and unless stop strings need
        checking every token, its text is decoded once at the end (offline generate: less work per step)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting; try again later")
        prompt_text, token_ids = self._tokenize(prompt)
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {max_len} "
                             "(the prompt must leave room for at least one generated token)")
        request = _Request(prompt_text, stream)
        for i in range(params.n):
            seq = Sequence(request_id, i, token_ids, params)
            seq.generator = params.make_generator(self.model_runner.device, index=i)
            seq.logprobs = [] if params.logprobs is not None else None
            detokenizer.init_offsets(seq)
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        self._prompt_tokens += len(token_ids)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started with skip_tokenizer_init: give prompts as token ids")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        return text, token_ids

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        if is_prefill:
            self._prefix_hits += sum(s.num_cached_tokens for s in seqs)
        logits = self.model_runner.execute(seqs, is_prefill)
        sampled = self.sampler(logits, seqs, self.eos_token_ids)
        for i, seq in enumerate(seqs):
            top = sampled.top_logprobs[i] if sampled.top_logprobs is not None else None
            logprob = sampled.logprobs[i] if sampled.logprobs is not None else None
            self._append_token(seq, sampled.token_ids[i], logprob, top)
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in seqs):
            request = self.requests[request_id]
            finished = all(s.is_finished for s in request.seqs)
            if request.stream or finished:
                outputs.append(self._request_output(request_id))
            if finished:
                del self.requests[request_id]
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: float | None, top: list | None) -> None:
        seq.output_token_ids.append(token)
        self._generation_tokens += 1
        if logprob is not None:
            seq.cumulative_logprob += logprob
            if seq.logprobs is not None:
                entry = dict(top or [])
                entry.setdefault(token, logprob)
                seq.logprobs.append(entry)
        params = seq.params
        stop_string = None
        if self.tokenizer is not None and (params.stop or self.requests[seq.request_id].stream):
            before = len(seq.text)
            detokenizer.append_text(self.tokenizer, seq)
            stop_string = detokenizer.find_stop_string(seq, len(seq.text) - before)
        if seq.num_output_tokens >= params.min_tokens:
            if stop_string is not None:
                seq.stop_reason = stop_string
                return self.scheduler.finish(seq, "stop")
            if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
                seq.stop_reason = token if token in params.stop_token_ids else None
                return self._finish_with_text(seq, "stop")
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or len(seq) >= self.config.max_model_len:
            self._finish_with_text(seq, "length")

    def _finish_with_text(self, seq: Sequence, reason: str) -> None:
        if self.tokenizer is not None:
            detokenizer.flush_text(self.tokenizer, seq)
        self.scheduler.finish(seq, reason)

    def _request_output(self, request_id: str) -> RequestOutput:
        request = self.requests[request_id]
        seqs = request.seqs
        outs = [CompletionOutput(s.index, detokenizer.visible_text(s), list(s.output_token_ids), s.finish_reason,
                                 s.stop_reason, s.logprobs, s.cumulative_logprob) for s in seqs]
        return RequestOutput(request_id, request.prompt, seqs[0].prompt_token_ids, outs,
                             all(s.is_finished for s in seqs))

    @property
    def stats(self) -> EngineStats:
        runner = self.model_runner
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_used=self.block_manager.num_used_blocks,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            decode_steps_graph=runner.decode_steps_graph,
            decode_steps_eager=runner.decode_steps_eager,
            padding_rows=runner.padding_rows,
            preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self._prefix_hits,
        )
