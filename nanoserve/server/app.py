"""OpenAI-compatible HTTP API: FastAPI routes, SSE streaming, auth, errors (metrics: metrics.py).

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions.
Every error answers in OpenAI's format {"error": {"message", "type", "param", "code"}}: invalid
requests 400 (unknown fields too, as api.openai.com does), wrong key 401, unknown model 404, full
waiting queue 503, engine failure 500. A client that goes away has its request aborted.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import LLMEngine, QueueFullError, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.server.async_engine import AsyncEngine, EngineError, EngineStoppedError, RequestStream
from nanoserve.server.metrics import ServerMetrics, Tracker
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

logger = logging.getLogger("nanoserve.server")

MAX_BODY_BYTES = 32 * 2**20  # a 32k-token prompt as token ids is ~0.3 MiB of JSON


class APIError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


# ---- ASGI pieces ---------------------------------------------------------------------------------


class _BodyTooLarge(Exception):
    pass


class _V1Middleware:
    """For /v1 routes: checks the API key before anything else (so a bad key is 401 even for a bad body),
    refuses bodies over MAX_BODY_BYTES, and counts responses by status code."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        status = 500  # what the outer ServerErrorMiddleware answers if the app raises

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        received = 0

        async def limited_receive():  # bodies sent without Content-Length (chunked) are counted as they come
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise _BodyTooLarge()  # FastAPI turns a failed body read into a 400
            return message

        try:
            if self.api_key is not None and not self._authorized(scope):
                resp = APIError(401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
                                code="invalid_api_key").response()
                return await resp(scope, receive, counting_send)
            length = dict(scope["headers"]).get(b"content-length", b"0")
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                resp = APIError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.").response()
                return await resp(scope, receive, counting_send)
            await self.app(scope, limited_receive, counting_send)
        finally:
            self.metrics.requests.labels(str(status)).inc()

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())


class SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client going away (whatever the ASGI spec version):
    a disconnect cancels the body iterator, whose cleanup aborts the engine request."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away mid-send
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            # a cancel that hit while the generator sat at a `yield` (or before it started) leaves its own
            # cleanup unrun: close it, and abort through on_close, now rather than at garbage collection
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            self.on_close()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _close(stream: RequestStream, tracker: Tracker) -> None:
    """Abort what is unfinished (the client left) and count it; a no-op once everything finished."""
    if not stream.finished:
        tracker.end("abort")
    stream.close()


def _finite(logprob: float | None) -> float | None:
    """-inf (and NaN) are not JSON: report them as -9999.0 (vLLM's convention for impossible tokens)."""
    if logprob is None:
        return None
    return max(-9999.0, logprob)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- the app -------------------------------------------------------------------------------------


class OpenAIServer:
    """Request handling shared by the routes: validation → SamplingParams → engine → OpenAI responses."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())

    # -- helpers --

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    @staticmethod
    def sampling_params(kwargs: dict, names: dict[str, str] | None = None) -> SamplingParams:
        """SamplingParams(**kwargs); its ValueError becomes a 400 naming the request's own field
        (`names` maps SamplingParams names to request names where they differ)."""
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:  # SamplingParams names the field first: "top_p must be ..."
            field, _, rest = str(e).partition(" ")
            if field not in kwargs:
                raise APIError(400, str(e)) from None
            field = (names or {}).get(field, field)
            raise APIError(400, f"{field} {rest}", param=field) from None

    async def start(self, prompts: list, params: SamplingParams, prefix: str) -> tuple[RequestStream, Tracker]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        items = [(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)]
        try:
            stream = await self.async_engine.add(items)
        except QueueFullError as e:
            raise APIError(503, f"The server is overloaded, retry later ({e}).", type="server_error",
                           code="queue_full") from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), type="server_error", code="engine_stopped") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return stream, Tracker(self.metrics, len(prompts), params.n)

    async def collect(self, request: Request, stream: RequestStream, tracker: Tracker) -> dict[int, RequestOutput]:
        """The final output of each prompt; aborts the requests if the client disconnects first."""

        async def run() -> dict[int, RequestOutput]:
            last: dict[int, RequestOutput] = {}
            try:
                async for i, out in stream:
                    tracker.observe(i, out)
                    last[i] = out
            except EngineError as e:
                tracker.end("error")
                raise APIError(500, str(e), type="server_error", code="engine_error") from None
            finally:
                _close(stream, tracker)
            return last

        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():  # the client went away (or this handler was cancelled)
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, APIError):
                    pass
        if task.cancelled():
            raise _ClientGone()
        return task.result()

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def completion_logprobs(self, token_ids, logprobs, offset: int) -> tuple[dict, int]:
        """OpenAI legacy format; top_logprobs holds the top-N plus the sampled token (as OpenAI documents)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, logprobs or []):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(_finite(lp.get(tid)))
            top: dict[str, float] = {}
            for t, v in sorted(lp.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.token_str(t), _finite(v))  # tokens decoding alike (partial UTF-8): keep the first
            tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat_logprobs(self, token_ids, logprobs, num_top: int) -> dict:
        content = []
        for tid, lp in zip(token_ids, logprobs or []):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:num_top]
            content.append({**self._chat_token(tid, lp.get(tid)),
                            "top_logprobs": [self._chat_token(t, v) for t, v in top]})
        return {"content": content, "refusal": None}

    def _chat_token(self, token_id: int, logprob: float | None) -> dict:
        s = self.token_str(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}

    @staticmethod
    def usage(last: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in last.values())
        completion = sum(len(c.token_ids) for o in last.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- /v1/completions --

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompts = _prompt_list(body.prompt)
        params = self.sampling_params({**body.sampling_kwargs(), "max_tokens": body.max_tokens,
                                       "logprobs": body.logprobs})
        stream, tracker = await self.start(prompts, params, "cmpl")
        head = {"id": stream.request_ids[0].rsplit("-", 1)[0], "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if body.stream:
            events = self._events(stream, tracker, head, params.n, body.include_usage, body.logprobs is not None,
                                  self._completion_choices(body))
            return SSEResponse(events, on_close=lambda: _close(stream, tracker))
        last = await self.collect(request, stream, tracker)
        choices = []
        for i in sorted(last):
            for c in last[i].outputs:
                lp = self.completion_logprobs(c.token_ids, c.logprobs, 0)[0] if body.logprobs is not None else None
                choices.append({"index": i * params.n + c.index, "text": c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({**head, "choices": choices, "usage": self.usage(last), "system_fingerprint": None})

    def _completion_choices(self, body: CompletionRequest):
        """Builds each streamed completion chunk's choice; keeps the running text_offset of each choice."""
        text_offset: dict[int, int] = {}

        def choice(index: int, c, delta: str, new_ids: list[int], new_lps, end: str | None) -> dict:
            lp = None
            if new_lps is not None:
                lp, text_offset[index] = self.completion_logprobs(new_ids, new_lps, text_offset.get(index, 0))
            return {"index": index, "text": delta, "logprobs": lp, "finish_reason": end,
                    "stop_reason": c.stop_reason if end else None}
        return choice

    async def _events(self, stream: RequestStream, tracker: Tracker, head: dict, n: int, include_usage: bool,
                      want_logprobs: bool, choice_for, preamble: tuple[dict, ...] = ()) -> AsyncIterator[str]:
        """Server-sent events of a streamed request: every completion's new text (and logprobs) as it is produced,
        then usage if asked and [DONE]. choice_for(index, completion, delta, new_ids, new_logprobs, finish) shapes
        one chunk's choice — the one place where completions and chat differ."""
        extra = {"usage": None} if include_usage else {}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        last: dict[int, RequestOutput] = {}
        try:
            for chunk in preamble:
                yield _sse({**head, **chunk, **extra})
            async for i, out in stream:
                tracker.observe(i, out)
                last[i] = out
                for c in out.outputs:
                    index = i * n + c.index
                    start = sent_tokens.get(index, 0)
                    delta, new_ids = c.text[sent_text.get(index, 0):], c.token_ids[start:]
                    end = c.finish_reason if c.finish_reason is not None and index not in finished else None
                    if not (delta or end or (want_logprobs and new_ids)):
                        continue
                    new_lps = (c.logprobs or [])[start:len(c.token_ids)] if want_logprobs else None
                    choice = choice_for(index, c, delta, new_ids, new_lps, end)
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if end is not None:
                        finished.add(index)
                    yield _sse({**head, "choices": [choice], **extra})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self.usage(last)})
        except EngineError as e:
            tracker.end("error")
            yield _sse(error_body(str(e), "server_error", None, "engine_error"))
        finally:
            _close(stream, tracker)
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions --

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise APIError(400, "Chat needs a tokenizer, and this server runs without one (skip_tokenizer_init).")
        if body.chat_template is None and not getattr(tok, "chat_template", None):
            raise APIError(400, "The model has no chat template: pass one as `chat_template` in the request, "
                                "or use /v1/completions.", param="chat_template")
        messages = [m.for_template() for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, chat_template=body.chat_template,
                                           add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # jinja errors, raise_exception() in templates ("roles must alternate", ...)
            raise APIError(400, f"The chat template could not render these messages: {e}", param="messages") from None
        return tok.encode(text, add_special_tokens=False)  # the template already holds BOS etc.

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        prompt_ids = self.chat_prompt(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        names = {"logprobs": "top_logprobs"}
        if body.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        params = self.sampling_params({**body.sampling_kwargs(), "max_tokens": max_tokens,
                                       "logprobs": (body.top_logprobs or 0) if body.logprobs else None}, names)
        stream, tracker = await self.start([prompt_ids], params, "chatcmpl")
        head = {"id": stream.request_ids[0].rsplit("-", 1)[0], "created": int(time.time()), "model": self.model_name}
        num_top = body.top_logprobs or 0
        if body.stream:
            role = tuple({"choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}]} for j in range(body.n))  # the role first, as OpenAI does
            events = self._events(stream, tracker, {**head, "object": "chat.completion.chunk"}, body.n,
                                  body.include_usage, bool(body.logprobs), self._chat_choice(num_top), role)
            return SSEResponse(events, on_close=lambda: _close(stream, tracker))
        last = await self.collect(request, stream, tracker)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, num_top) if body.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in last[0].outputs]
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": self.usage(last),
                             "system_fingerprint": None})

    def _chat_choice(self, num_top: int):
        def choice(index: int, c, delta: str, new_ids: list[int], new_lps, end: str | None) -> dict:
            lp = self.chat_logprobs(new_ids, new_lps, num_top) if new_lps is not None else None
            return {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                    "finish_reason": end, "stop_reason": c.stop_reason if end else None}
        return choice

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoserve",
                "max_model_len": self.engine.config.max_model_len}


class _ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready (its request was aborted)."""


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error belongs to in `loc`: 'str', 'list[int]', 'TextPart', ..."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper())


def _validation_message(errors) -> tuple[str, str | None]:
    """FastAPI/pydantic errors → one readable line and the first offending parameter. A value that fits
    no member of a union (prompt, stop, content) gets one line listing the accepted forms."""
    parts: dict[str, list[str]] = {}  # field path → messages
    forms: dict[str, list[str]] = {}  # field path → union members tried
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}.", None
        loc = [x for x in err.get("loc", ()) if x != "body"]
        tags = [i for i, x in enumerate(loc) if _is_union_tag(x)]
        path = ".".join(str(x) for x in (loc[:tags[0]] if tags else loc))
        if tags:
            forms.setdefault(path, []).append(loc[tags[0]])
        if err.get("type") == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {path}"
        elif not path:
            msg = f"The request body must be a JSON object: {err.get('msg')}"
        else:
            msg = f"{path}: {err.get('msg')}"
        parts.setdefault(path, []).append(msg)
    lines = []
    for path, msgs in parts.items():
        kinds = list(dict.fromkeys(forms.get(path, [])))
        lines.append(f"{path}: must be one of {', '.join(kinds)}" if len(kinds) > 1 else msgs[0])
    first = next(iter(parts), "")
    return "; ".join(lines) or "Invalid request.", first.split(".", 1)[0] or None


def build_app(engine: LLMEngine | EngineConfig | str, *, api_key: str | None = None,
              served_model_name: str | None = None, **engine_options) -> FastAPI:
    """The FastAPI app. `engine` is a model folder (+ EngineConfig options as keywords), an EngineConfig,
    or a ready LLMEngine. The engine thread starts and stops with the app's lifespan."""
    if isinstance(engine, str):
        engine = EngineConfig.from_kwargs(engine, **engine_options)
    elif engine_options:
        raise TypeError(f"engine options {sorted(engine_options)} are only accepted with a model folder")
    if isinstance(engine, EngineConfig):
        engine = LLMEngine(engine)
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(async_engine)
    server = OpenAIServer(async_engine, served_model_name or engine.config.model, metrics)

    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.async_engine, app.state.engine, app.state.metrics, app.state.server = async_engine, engine, metrics, server
    app.add_middleware(_V1Middleware, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return server.models()

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        server.check_model(model)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    return app


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, log_level: str = "info") -> None:
    """Load the model, then serve the OpenAI API until interrupted (what `nanoserve serve` runs)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config, api_key=api_key, served_model_name=served_model_name)
    logger.info("serving %s on http://%s:%d/v1", app.state.server.model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
