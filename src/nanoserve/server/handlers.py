"""OpenAIServer: what /v1/completions and /v1/chat/completions do between the body and the response.

parse and validate → SamplingParams → prompts tokenized off the loop (preprocess.py) → checked against
the engine's limits → submitted through the EngineClient (the front end the offline LLM runs too) → a JSON
answer once everything finished, or server-sent events as each completion grows. Each SSE write carries
everything that arrived since the previous one (RequestCollector merges), so a slow client gets bigger
chunks, never a backlog. A RequestError the engine's checks raise is answered 400 with its field as `param`
(app.py); here it is only renamed where the request calls the field otherwise.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import Response

from nanoserve.config import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from nanoserve.engine.output import RequestOutput
from nanoserve.engine.prompts import QueueFullError, as_prompt_list, check_max_tokens
from nanoserve.errors import RequestError
from nanoserve.engine.stop_matcher import StopMatcher
from nanoserve.sampling import SamplingParams
from nanoserve.server.client import EngineClient
from nanoserve.server.collector import EngineError, EngineStoppedError, RequestCollector, RequestRejectedError
from nanoserve.server.echo import echo_choices
from nanoserve.server.logprobs import TokenTexts
from nanoserve.server.metrics import ServerMetrics, Tracker
from nanoserve.server.preprocess import Preprocessor
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.server.request_body import APIError, error_body
from nanoserve.server.request_body import ClientGone, parse_request
from nanoserve.server.sse import SSEResponse
from nanoserve.server.tool_calls import ToolCalling, auto_parser_name, renders_tools


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _close(collector: RequestCollector, tracker: Tracker) -> None:
    """Abort what is unfinished (the client left) and count it; a no-op once everything finished."""
    if not collector.finished:
        tracker.end("abort")
    collector.close()


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, RequestRejectedError):
        return APIError(400, str(e), code="engine_rejected")
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), type="server_error", code="engine_stopped")
    return APIError(500, str(e), type="server_error", code="engine_dead")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    def __init__(self, client: EngineClient, preprocessor: Preprocessor, token_texts: TokenTexts, model_name: str,
                 metrics: ServerMetrics, trust_request_chat_template: bool = False,
                 stop_limits: tuple[int, int] = (MAX_STOP_STRINGS, MAX_STOP_STRING_LEN),
                 tool_call_parser: str = "auto"):
        self.client, self.preprocessor, self.token_texts = client, preprocessor, token_texts
        self.tool_call_parser = tool_call_parser
        model_template = getattr(preprocessor.tokenizer, "chat_template", None)
        self.model_tool_parser = auto_parser_name(tool_call_parser, model_template)  # tool_choice "auto"'s
        self.stop_limits = stop_limits
        self.model_name, self.metrics = model_name, metrics
        self.trust_request_chat_template = trust_request_chat_template
        self.created = int(time.time())
        self._renders_tools: dict[str, bool] = {}  # chat template → whether it renders `tools`

    # -- checks -----------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def sampling_params(self, kwargs: dict, names: dict[str, str] | None = None) -> SamplingParams:
        """SamplingParams(**kwargs) fitted to this model (the front end's check_params); a RequestError names the
        request's own field (`names` maps SamplingParams names to request names where they differ; a field the
        request did not send, such as structured_outputs.json, is named by none)."""
        try:
            return self.client.check_params(SamplingParams(**kwargs))
        except RequestError as e:
            if e.param not in kwargs:
                raise RequestError(e.message) from None
            raise e.renamed((names or {}).get(e.param, e.param)) from None

    async def stop_matcher(self, params: SamplingParams) -> StopMatcher | None:
        """The request's stop strings within --max-stop-strings / --max-stop-string-len (else 400), their automaton
        built off the event loop. The handler holds it until the request is submitted (where the front end finds
        it in StopMatcher's cache)."""
        if not params.stop:
            return None
        count, length = self.stop_limits
        if len(params.stop) > count:
            raise APIError(400, f"stop: {len(params.stop)} stop strings, more than this server takes "
                                f"(--max-stop-strings={count}).", param="stop")
        longest = max(params.stop, key=len)
        if len(longest) > length:
            raise APIError(400, f"stop: a stop string of {len(longest)} characters, longer than this server takes "
                                f"(--max-stop-string-len={length}).", param="stop")
        return await asyncio.to_thread(StopMatcher.of, params.stop)

    async def check_structured_outputs(self, params: SamplingParams, body, param: str | None = None) -> None:
        """The output constraint compiles, checked off the event loop: an invalid schema, regex or grammar is a 400
        naming the problem, and never reaches the engine core. param: the field it came from, when not the body's
        response_format / structured_outputs (tool_choice's schema comes from `tools`)."""
        if params.structured_outputs is None:
            return
        param = param or body.structured_outputs_param
        where = {"response_format": "response_format.json_schema.schema",
                 "tools": "tools[].function.parameters"}.get(param)
        try:
            await self.preprocessor.constraints.check(params.structured_outputs, where)
        except RequestError as e:
            raise e.renamed(param) from None

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        try:
            check_max_tokens(num_prompt_tokens, max_tokens, self.client.config.max_model_len)
        except RequestError as e:
            raise e.renamed(param) from None

    def submit(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
               prefix: str) -> tuple[RequestCollector, Tracker]:
        tracker = Tracker(self.metrics, len(prompts), params.n)
        try:
            collector = self.client.add(prompts, params, prefix, observer=tracker.observe)
        except QueueFullError as e:
            raise APIError(503, f"The server is overloaded, retry later ({e}).", type="server_error",
                           code="queue_full") from None
        except EngineStoppedError as e:
            raise _engine_error(e) from None
        return collector, tracker

    def usage(self, collector: RequestCollector) -> dict:
        prompt, completion = collector.num_prompt_tokens, collector.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def result(self, request: Request, collector: RequestCollector,
                     tracker: Tracker) -> list[tuple[int, RequestOutput]]:
        """Everything, once finished; aborts the request if the client disconnects first."""
        task = asyncio.ensure_future(collector.result())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise ClientGone()
            try:
                return task.result()
            except (EngineError, RequestRejectedError) as e:
                tracker.end("error")
                raise _engine_error(e) from None
        finally:
            watcher.cancel()
            task.cancel()
            _close(collector, tracker)

    # -- /v1/completions --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await parse_request(request, CompletionRequest)
        self.check_model(body.model)
        try:
            prompts = as_prompt_list(body.prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        echo_only = body.echo and body.max_tokens == 0  # the prompt alone: one token is generated and dropped
        params = self.sampling_params({**body.sampling_kwargs(), "max_tokens": 1 if echo_only else body.max_tokens,
                                       "logprobs": body.logprobs,
                                       "prompt_logprobs": body.logprobs if body.echo else None})
        await self.check_structured_outputs(params, body)
        stops = await self.stop_matcher(params)  # noqa: F841 (held until submitted)
        self.client.check_fits(len(prompts) * params.n)
        if body.echo and self.token_texts.tokenizer is None:
            raise APIError(400, "echo needs a tokenizer, and this server runs without one (skip_tokenizer_init).",
                           param="echo")
        tokenized = await self.preprocessor.completion_prompts(prompts)
        for _, ids in tokenized:
            self.check_max_tokens(len(ids), params.max_tokens, "max_tokens")
        collector, tracker = self.submit(tokenized, params, "cmpl")
        head = {"id": collector.request_ids[0].rsplit("-", 1)[0], "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        choice = self._completion_choice(body.logprobs is not None)
        if body.echo:
            choice = echo_choices(choice, collector, tokenized, params.n, self.token_texts, body.logprobs is not None,
                                  echo_only)
        if body.stream:
            events = self._events(collector, tracker, head, body, body.logprobs is not None, choice)
            return SSEResponse(events, on_close=lambda: _close(collector, tracker))
        choices = []
        for i, out in await self.result(request, collector, tracker):
            for c in out.outputs:
                item = choice(i * params.n + c.index, c)
                if body.return_token_ids:
                    item.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
                choices.append(item)
        return json_response({**head, "choices": choices, "usage": self.usage(collector), "system_fingerprint": None})

    def _completion_choice(self, want_logprobs: bool) -> Callable:
        """Shapes a completion choice; keeps each choice's running text_offset for streamed logprobs."""
        text_offset: dict[int, int] = {}

        def choice(index: int, c) -> dict:
            lp = None
            if want_logprobs:
                lp, text_offset[index] = self.token_texts.completion_logprobs(c.token_ids, c.logprobs or [],
                                                                              text_offset.get(index, 0))
            return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason if c.finish_reason else None}
        return choice

    # -- /v1/chat/completions ---------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await parse_request(request, ChatCompletionRequest)
        collector, tracker, tools, ids, params = await self.start_chat(body)
        return await self.chat_answer(request, body, collector, tracker, tools, ids, params)

    async def start_chat(self, body: ChatCompletionRequest, max_tokens_param: str | None = None,
                         prefix: str = "chatcmpl") -> tuple[RequestCollector, Tracker, ToolCalling, list[int],
                                                            SamplingParams]:
        """A chat request's checks, prompt and submission (for chat and the Responses API, server/responses.py):
        its collector and tracker, tool calling, prompt ids and parameters. max_tokens_param: the request's name for
        max_tokens, where a 400 about it points."""
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        if body.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "`chat_template` in a request is refused: this server was not started with "
                                "--trust-request-chat-template.", param="chat_template")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        names = {"logprobs": "top_logprobs"}
        if body.max_completion_tokens is not None:
            names["max_tokens"] = max_tokens_param or "max_completion_tokens"
        tools = self.tool_calling(body)
        if tools.mode == "auto" and body.chat_template is None and not await self.template_renders_tools():
            raise APIError(400, 'tool_choice "auto" (the default with tools): this model\'s chat template does not '
                                'render `tools`, so the model would never see them. Use tool_choice "required" or a '
                                'named function (the output is constrained to a call, with any model) or "none", or '
                                'serve a template that renders tools (--chat-template).', param="tool_choice")
        params = self.sampling_params({**body.sampling_kwargs(), "max_tokens": max_tokens,
                                       "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
                                       **self.tool_constraint(body, tools)}, names)
        await self.check_structured_outputs(params, body, "tools" if tools.structured_outputs is not None else None)
        stops = await self.stop_matcher(params)  # noqa: F841 (held until submitted)
        self.client.check_fits(params.n)
        ids = await self.preprocessor.chat_prompt([m.for_template() for m in body.messages],
                                                  body.add_generation_prompt, body.chat_template, body.template_tools())
        self.check_max_tokens(len(ids), params.max_tokens, names.get("max_tokens", "max_tokens"))
        collector, tracker = self.submit([(None, ids)], params, prefix)
        return collector, tracker, tools, ids, params

    async def chat_answer(self, request: Request, body: ChatCompletionRequest, collector: RequestCollector,
                          tracker: Tracker, tools: ToolCalling, ids: list[int], params: SamplingParams) -> Response:
        """The chat completion object, or its stream of chunks."""
        head = {"id": collector.request_ids[0].rsplit("-", 1)[0], "created": int(time.time()),
                "model": self.model_name}
        num_top = body.top_logprobs or 0
        if body.stream:
            role = tuple({"choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}]} for j in range(params.n))  # the role first, as OpenAI
            if body.return_token_ids:  # vLLM's place for a chat stream: the first chunk's top level
                role = ({**role[0], "prompt_token_ids": ids}, *role[1:])
            choice = self._chat_chunk_choice(body.logprobs, num_top, tools, body.return_token_ids)
            events = self._events(collector, tracker, {**head, "object": "chat.completion.chunk"}, body,
                                  body.logprobs, choice, role, prompt_ids_in_choices=False)
            return SSEResponse(events, on_close=lambda: _close(collector, tracker))
        choices = []
        for c in [c for _, out in await self.result(request, collector, tracker) for c in out.outputs]:
            message, finish_reason = tools.message(c.text, c.finish_reason)
            item = {"index": c.index, "message": message,
                    "logprobs": self.token_texts.chat_logprobs(c.token_ids, c.logprobs or [], num_top)
                    if body.logprobs else None, "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:
                item["token_ids"] = c.token_ids
            choices.append(item)
        answer = {**head, "object": "chat.completion", "choices": choices, "usage": self.usage(collector),
                  "system_fingerprint": None}
        if body.return_token_ids:
            answer["prompt_token_ids"] = ids
        return json_response(answer)

    async def template_renders_tools(self) -> bool:
        """Whether the model's chat template shows `tools` to the model: probed once per template, on the tokenizer
        thread."""
        tokenizer = self.preprocessor.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        key = template if isinstance(template, str) else repr(template)
        if key not in self._renders_tools:
            self._renders_tools[key] = await self.preprocessor._run(renders_tools, tokenizer)
        return self._renders_tools[key]

    def tool_calling(self, body: ChatCompletionRequest) -> ToolCalling:
        """The request's tool choice; its "auto" parser is the server's, or the request template's when it sends one
        (with --tool-call-parser auto)."""
        parser = self.model_tool_parser
        if body.chat_template is not None and self.tool_call_parser == "auto":
            parser = auto_parser_name("auto", body.chat_template)
        return ToolCalling(body, parser)

    @staticmethod
    def tool_constraint(body: ChatCompletionRequest, tools: ToolCalling) -> dict:
        """SamplingParams' structured_outputs for tool_choice "required" or a named function (else nothing)."""
        if tools.structured_outputs is None:
            return {}
        if body.sampling_kwargs().get("structured_outputs") is not None:
            raise APIError(400, f"tool_choice {tools.mode!r} constrains the output itself: it cannot be combined with "
                                "response_format or structured_outputs.", param="tool_choice")
        return {"structured_outputs": tools.structured_outputs}

    def _chat_chunk_choice(self, want_logprobs: bool, num_top: int, tools: ToolCalling,
                           keep_empty: bool) -> Callable:
        """Shapes a chunk's choice; with tools, each choice's text goes through a parser of its own, and a chunk whose
        text it holds back is left out (unless it carries logprobs or token ids)."""
        streams = {}

        def choice(index: int, c) -> dict | None:
            delta, finish_reason = {"content": c.text} if c.text else {}, c.finish_reason
            if tools.parses:
                stream = streams.get(index) or streams.setdefault(index, tools.stream())
                delta, finish_reason = stream.delta(c.text, c.finish_reason)
                if not (delta or finish_reason or want_logprobs or keep_empty):
                    return None
            lp = self.token_texts.chat_logprobs(c.token_ids, c.logprobs or [], num_top) if want_logprobs else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason if finish_reason else None}
        return choice

    # -- streaming --------------------------------------------------------------------------------
    async def _events(self, collector: RequestCollector, tracker: Tracker, head: dict, body, want_logprobs: bool,
                      choice_for: Callable, preamble: tuple[dict, ...] = (),
                      prompt_ids_in_choices: bool = True) -> AsyncIterator[bytes]:
        """Server-sent events of a streamed request: each completion's new text (token ids, logprobs) as it
        grows, then usage if asked and [DONE]. An engine failure arrives as an error event. With return_token_ids a
        completion's first choice chunk carries its prompt's ids (a chat stream has them in its preamble)."""
        extra = {"usage": None} if body.include_usage else {}
        with_ids, n = body.return_token_ids, collector.n
        first_chunk = set(range(len(collector.request_ids) * n))
        try:
            if preamble:
                yield b"".join(_sse({**head, **chunk, **extra}) for chunk in preamble)
            while True:
                events = []
                for i, out in await collector.get():
                    for c in out.outputs:
                        if not (c.text or c.finish_reason or (c.token_ids and (want_logprobs or with_ids))):
                            continue
                        index = i * n + c.index
                        choice = choice_for(index, c)
                        if choice is None:  # nothing to send yet
                            continue
                        if with_ids:
                            choice["token_ids"] = c.token_ids
                            if index in first_chunk and prompt_ids_in_choices:
                                choice["prompt_token_ids"] = out.prompt_token_ids
                        first_chunk.discard(index)
                        events.append(_sse({**head, "choices": [choice], **extra}))
                if events:
                    yield b"".join(events)
                if collector.finished:
                    break
            if body.include_usage:
                yield _sse({**head, "choices": [], "usage": self.usage(collector)})
        except (EngineError, RequestRejectedError) as e:
            tracker.end("error")
            error = _engine_error(e)
            yield _sse(error_body(error.message, error.type, None, error.code))
        finally:
            _close(collector, tracker)
        yield b"data: [DONE]\n\n"

    # -- /v1/models -------------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        # root: the model's path, as vLLM's cards give it (a served name is not one): `bench serve` reads the tokenizer
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoserve",
                "root": self.client.config.model, "max_model_len": self.client.config.max_model_len}
