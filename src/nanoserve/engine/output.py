"""The front end of the engine: per-step token deltas → text, stop strings, n > 1 fan-in, RequestOutputs.

One place turns the core's SeqOutputs into what users see, for the offline LLM and the server alike.
A request with n completions becomes n core sequences (child ids `<request_id>/<i>`, seed + i). Text is
released only once final: an incomplete UTF-8 character waits for the next token, and a tail that could
still become a stop string is held back until it cannot. A stop string ends its completion here; the
caller aborts the core sequence (`ProcessedOutputs.aborts`).

Outputs come as deltas (what each step added: text, token ids, logprobs) for streaming, or once per
request when everything finished (offline generate), decoded once at the end when no stop string needs
checking on the way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nanoserve.engine import detokenizer
from nanoserve.engine.messages import EngineRequest, SeqOutput
from nanoserve.engine.stop_matcher import StopMatcher
from nanoserve.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str  # the delta's new text, or the whole text when reported once at the end
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None  # per token of token_ids: {token id: logprob}, the sampled one included
    cumulative_logprob: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # the core refused or dropped the request
    # params.prompt_logprobs: per prompt token {token id: logprob} (its own and the top ones); None for the first.
    # Sent once: with the first output that has them (a stream's first delta), and with a whole result.
    prompt_logprobs: list[dict[int, float] | None] | None = None

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
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # core sequences a stop string ended: abort them in the core


class _Completion:
    """One completion's text state."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, tokenizer, incremental: bool):
        self.index, self.params, self.tokenizer, self.prompt_ids = index, params, tokenizer, prompt_ids
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent_tokens = self.sent_text = 0  # what earlier deltas reported
        self.end_reported = False
        self.waiting = True  # no output from the core yet
        self.detok = None
        self.stops = StopMatcher.of(params.stop) if params.stop and tokenizer is not None else None
        self.stop_state = 0  # the stop matcher's state after self.text
        if tokenizer is not None and (incremental or params.stop):
            self.detok = detokenizer.IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, out: SeqOutput) -> bool:
        """Take one delta; True when a stop string ended the completion (the core must be told). A delta of several
        tokens (verified drafts) is read token by token: a stop string completed inside it drops the tokens after."""
        before = len(self.token_ids)
        self.token_ids += out.new_token_ids
        if out.token_logprobs is not None:
            self.cumulative_logprob += sum(out.token_logprobs)
            if self.logprobs is not None:
                for token, lp, top in zip(out.new_token_ids, out.token_logprobs, out.top_logprobs):
                    entry = dict(top)
                    entry.setdefault(token, lp)
                    self.logprobs.append(entry)
        taken = self._extend_text(out.new_token_ids, before) if self.detok is not None else None
        if taken is not None:
            if taken < len(out.new_token_ids):
                del self.token_ids[before + taken:]
                if out.token_logprobs is not None:
                    self.cumulative_logprob -= sum(out.token_logprobs[taken:])
                    if self.logprobs is not None:
                        del self.logprobs[before + taken:]
            return True
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            if self.tokenizer is not None and out.finish_reason in ("stop", "length"):
                self.text = detokenizer.full_text(self.tokenizer, self.prompt_ids, self.token_ids,
                                                  self.params.skip_special_tokens)
        return False

    def _extend_text(self, new_ids: list[int], before: int) -> int | None:
        """Push the tokens' text; when a stop string ends the completion, how many of new_ids it took (else None)."""
        if self.stops is None:
            for t in new_ids:
                self.text += self.detok.push(t)
            return None
        for i, t in enumerate(new_ids):
            end = len(self.text)
            self.text += self.detok.push(t)
            while True:  # stop strings completed before min_tokens are passed over
                self.stop_state, end, stop = self.stops.feed(self.stop_state, self.text, end)
                if stop is None:
                    break
                if self.params.reached_min_tokens(before + i + 1):
                    at = end - len(stop)
                    self.text = self.text[:at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
                    self.finish_reason, self.stop_reason = "stop", stop
                    return i + 1
        return None

    def visible_text(self) -> str:
        if self.finished or self.stops is None:
            return self.text
        return self.text[:len(self.text) - self.stops.held_back(self.stop_state)]

    def delta(self) -> CompletionOutput | None:
        """What changed since the last delta, or None."""
        text = self.visible_text()
        new_text, new_ids = text[self.sent_text:], self.token_ids[self.sent_tokens:]
        if not (new_text or new_ids or (self.finished and not self.end_reported)):
            return None
        lps = self.logprobs[self.sent_tokens:] if self.logprobs is not None else None
        self.sent_text, self.sent_tokens = len(text), len(self.token_ids)
        self.end_reported = self.finished
        return CompletionOutput(self.index, new_text, new_ids, self.finish_reason, self.stop_reason, lps,
                                self.cumulative_logprob)

    def whole(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                self.logprobs, self.cumulative_logprob)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    stream: bool
    num_unfinished: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        self._children: dict[str, tuple[_Request, _Completion]] = {}
        # core sequences submitted that have produced no output yet: what max_waiting_requests bounds (counted here,
        # so the in-process and the out-of-process core are bounded alike, without asking the core)
        self.num_waiting = 0

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool) -> list[EngineRequest]:
        """Track a request; the core requests to submit for it (one per completion)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        completions = [_Completion(i, prompt_token_ids, params, self.tokenizer, stream) for i in range(params.n)]
        request = _Request(request_id, prompt, prompt_token_ids, completions, stream, num_unfinished=params.n)
        self.requests[request_id] = request
        self.num_waiting += params.n
        core_requests = []
        for i, c in enumerate(completions):
            child = child_id(request_id, i)
            self._children[child] = (request, c)
            seed = None if params.seed is None else (params.seed + i) % 2**64
            core_requests.append(EngineRequest(child, prompt_token_ids, dataclasses.replace(params, n=1, seed=seed)))
        return core_requests

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; the core sequences to abort."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return []
        ids = [child_id(request_id, c.index) for c in request.completions]
        for child in ids:
            self._children.pop(child, None)
        self.num_waiting -= sum(c.waiting for c in request.completions)
        return [child for child, c in zip(ids, request.completions) if not c.finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process(self, outputs: list[SeqOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        touched: dict[str, _Request] = {}
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:  # aborted meanwhile, or ended by a stop string already
                continue
            request, completion = entry
            if completion.waiting:
                completion.waiting = False
                self.num_waiting -= 1
            if completion.append(out):
                result.aborts.append(out.request_id)
            if out.num_cached_tokens:
                request.num_cached_tokens = max(request.num_cached_tokens, out.num_cached_tokens)
            if out.error is not None:
                request.error = out.error
            if out.prompt_logprobs is not None and request.prompt_logprobs is None:
                request.prompt_logprobs = prompt_logprob_dicts(request.prompt_token_ids, out.prompt_logprobs)
            if completion.finished:
                del self._children[out.request_id]
                request.num_unfinished -= 1
            touched[request.request_id] = request
        for request in touched.values():
            output = self._output(request)
            if output is not None:
                result.outputs.append(output)
            if request.finished:
                del self.requests[request.request_id]
        return result

    def _output(self, request: _Request) -> RequestOutput | None:
        finished = request.finished
        if request.stream:
            outs = [d for d in (c.delta() for c in request.completions) if d is not None]
            if not outs:
                return None
        elif finished:
            outs = [c.whole() for c in request.completions]
        else:
            return None
        prompt_logprobs = None if request.prompt_logprobs_sent else request.prompt_logprobs
        request.prompt_logprobs_sent = prompt_logprobs is not None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs, finished,
                             request.num_cached_tokens, request.error, prompt_logprobs)


def prompt_logprob_dicts(prompt_ids: list[int], pairs: list) -> list[dict[int, float] | None]:
    """The core's (logprob, top pairs) per prompt token after the first → {token id: logprob}, None first."""
    out: list[dict[int, float] | None] = [None]
    for token, (lp, top) in zip(prompt_ids[1:], pairs):
        entry = dict(top)
        entry.setdefault(token, lp)
        out.append(entry)
    return out


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}/{index}"
