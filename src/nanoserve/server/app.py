"""OpenAI-compatible HTTP API: the FastAPI app, its error handlers, and `serve()` (what `nanoserve serve` runs).

The engine core runs in a process of its own (server/client.py); this process does HTTP, validation,
tokenization and chat templates (off the event loop), detokenization and stop strings, and SSE.
Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST
/v1/responses (server/responses.py), and
vLLM's /version, /ping, /tokenize, /detokenize (server/tokenize_routes.py).
Every error answers in OpenAI's format {"error": {"message", "type", "param", "code"}}: invalid
requests 400 (unknown fields too, as api.openai.com does), wrong key 401, a cross-origin request from an origin
not in --allowed-origins 403, unknown model 404, body not received within --request-body-timeout 408, body too
large 413, a body that is not JSON 415 (server/guard.py: one gate for every route), full waiting queue 503,
engine failure 500; a RequestError from the engine's checks is a 400 whose `param` is the field it carries. A client
that goes away has its request aborted. If the engine core dies, requests in flight fail at once and
`serve()` exits non-zero; SIGTERM/SIGINT drain (server/shutdown.py) and exit 0.
"""
from __future__ import annotations

import asyncio
import logging
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanoserve.config import (MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, REQUEST_BODY_TIMEOUT_S, SHUTDOWN_TIMEOUT_S,
                              TOOL_CALL_PARSER_CHOICES, EngineConfig)
from nanoserve.engine.core_process import freeze_heap
from nanoserve.engine.preflight import check_engine_config
from nanoserve.errors import RequestError
from nanoserve.hub import resolve_config
from nanoserve.model_files import load_tokenizer
from nanoserve.server.client import EngineClient
from nanoserve.server.guard import BodyTimeout, BodyTooLarge, RequestGuard, parse_origins, too_large
from nanoserve.server.handlers import ClientGone, OpenAIServer, json_response
from nanoserve.server.logprobs import TokenTexts
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.preprocess import Preprocessor
from nanoserve.server.request_body import APIError, error_body, validation_message
from nanoserve.server.responses import ResponsesAPI
from nanoserve.server.responses_protocol import RESPONSES_STORE_BYTES, ResponseStore
from nanoserve.server.shutdown import DrainingServer
from nanoserve.server.stat_log import StatLogger
from nanoserve.server.template_sandbox import DEFAULT_TIMEOUT_S, TemplateSandbox
from nanoserve.server.tokenize_routes import add_tokenize_routes

logger = logging.getLogger("nanoserve.server")

def _error_response(e: APIError) -> Response:
    return json_response(error_body(e.message, e.type, e.param, e.code), status=e.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return _error_response(too_large())

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, exc: BodyTimeout):
        timeout = request.app.state.body_timeout
        response = _error_response(APIError(408, f"The request body was not received within {timeout:g} s "
                                                 "(--request-body-timeout).", code="request_timeout"))
        response.headers["Connection"] = "close"
        return response

    @app.exception_handler(RequestError)  # the engine's checks: the field at fault travels as data
    async def _request_error(request: Request, exc: RequestError):
        return _error_response(APIError(400, exc.message, param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)  # gone while sending its body
    async def _client_gone(request: Request, exc: Exception):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s", request.url.path, exc_info=exc)
        return _error_response(APIError(500, f"Internal server error: {type(exc).__name__}", "server_error"))


def _lifespan(client: EngineClient, preprocessor: Preprocessor, log_stats: bool):
    """The app's lifespan: the engine client connected (and the stats lines running) while it serves."""
    async def lifespan(app: FastAPI):
        await client.start()
        stat_log = asyncio.create_task(StatLogger(client).run()) if log_stats else None
        try:
            yield
        finally:
            if stat_log is not None:
                stat_log.cancel()
            await client.shutdown()
            preprocessor.close()
    return lifespan


def build_app(model: str | EngineConfig | EngineClient, *, api_key: str | None = None,
              served_model_name: str | None = None, trust_request_chat_template: bool = False,
              chat_template_timeout_s: float = DEFAULT_TIMEOUT_S, log_level: str = "info",
              request_body_timeout: float = REQUEST_BODY_TIMEOUT_S, max_stop_strings: int = MAX_STOP_STRINGS,
              max_stop_string_len: int = MAX_STOP_STRING_LEN, tool_call_parser: str = "auto",
              allowed_origins: list[str] | None = None, chat_template: str | None = None,
              responses_store_bytes: int = RESPONSES_STORE_BYTES, log_stats: bool = True,
              **engine_options) -> FastAPI:
    """The FastAPI app. `model` is a model folder (+ EngineConfig options as keywords), an EngineConfig, or
    a started EngineClient. The engine core process is started here (EngineStartError if it cannot start),
    connected when the app's lifespan starts and stopped when it ends. log_stats: the periodic stats lines
    (server/stat_log.py)."""
    _check_server_limits(request_body_timeout=request_body_timeout, max_stop_strings=max_stop_strings,
                         max_stop_string_len=max_stop_string_len)
    _check_app_options(tool_call_parser, responses_store_bytes)
    origins = parse_origins(allowed_origins)  # origins a browser page may call this server from (server/guard.py)
    chat_template = _template_text(chat_template) if chat_template is not None else None
    client, served_model_name = _engine_client(model, served_model_name, log_level, engine_options)
    config = client.config
    tokenizer_path = config.tokenizer or config.model
    with_tokenizer = not config.skip_tokenizer_init
    # the tokenizer thread gets a tokenizer of its own: the event loop's detokenizer never shares one
    prompt_tokenizer = load_tokenizer(tokenizer_path) if with_tokenizer else None
    if chat_template is not None and prompt_tokenizer is not None:
        prompt_tokenizer.chat_template = chat_template
    sandbox = None
    max_model_len = client.config.max_model_len
    preprocessor = Preprocessor(prompt_tokenizer, client.vocab_size, max_model_len)
    if trust_request_chat_template and with_tokenizer:
        sandbox = preprocessor.sandbox = TemplateSandbox(tokenizer_path, preprocessor.max_chars,
                                                         chat_template_timeout_s)
    metrics = ServerMetrics(client)
    server = OpenAIServer(client, preprocessor, TokenTexts(client.tokenizer), served_model_name, metrics,
                          trust_request_chat_template,
                          stop_limits=(max_stop_strings, max_stop_string_len), tool_call_parser=tool_call_parser)

    app = FastAPI(title="nanoserve", lifespan=_lifespan(client, preprocessor, log_stats))
    app.state.engine_client, app.state.metrics, app.state.server, app.state.sandbox = client, metrics, server, sandbox
    app.state.body_timeout = request_body_timeout
    app.add_middleware(RequestGuard, api_key=api_key, metrics=metrics, body_timeout=request_body_timeout,
                       allowed_origins=origins)
    if origins:  # answers the allowed origins' preflights (before the key check: a preflight carries no key)
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["*"], allow_headers=["*"],
                           allow_credentials="*" not in origins)
    _add_error_handlers(app)
    _add_routes(app, server, client, metrics)
    app.state.responses = responses = ResponsesAPI(server, ResponseStore(responses_store_bytes))

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await responses.create(request)

    add_tokenize_routes(app, server)
    return app


def _check_app_options(tool_call_parser: str, responses_store_bytes: int) -> None:
    if tool_call_parser not in TOOL_CALL_PARSER_CHOICES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_CHOICES)}, got "
                         f"{tool_call_parser!r}")
    if isinstance(responses_store_bytes, bool) or not isinstance(responses_store_bytes, int) or \
            responses_store_bytes < 0:
        raise ValueError(f"responses_store_bytes must be a number of bytes >= 0, got {responses_store_bytes!r}")


def _engine_client(model, served_model_name: str | None, log_level: str, engine_options: dict):
    """(the EngineClient, the name the API serves) for a model folder (+ options), an EngineConfig, or a started
    EngineClient; a bad model or option fails before any tokenizer loads or the core starts."""
    if isinstance(model, str):
        model = EngineConfig.from_kwargs(model, **engine_options)
    elif engine_options:
        raise TypeError(f"engine options {sorted(engine_options)} are only accepted with a model folder")
    if isinstance(model, EngineClient):
        return model, served_model_name or model.config.model
    if not isinstance(model, EngineConfig):
        raise TypeError(f"build_app runs the engine core in its own process: give a model folder, an EngineConfig "
                        f"or an EngineClient, not {type(model).__name__}")
    served_model_name = served_model_name or model.model  # a hub id is served under its id, not its snapshot folder
    model = resolve_config(model)
    hf_config = check_engine_config(model)[1]
    tokenizer = None if model.skip_tokenizer_init else load_tokenizer(model.tokenizer or model.model)
    return EngineClient(model, tokenizer, log_level, hf_config), served_model_name


def _template_text(template: str) -> str:
    """--chat-template as vLLM takes it: a file's path, or the template itself."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template:
        raise ValueError(f"--chat-template: {template!r} is neither a file nor a Jinja template")
    return template


def _check_server_limits(**limits) -> None:
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def _add_routes(app: FastAPI, server: OpenAIServer, client: EngineClient, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health():
        if not client.is_running:
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
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat(request)


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, trust_request_chat_template: bool = False,
          log_level: str = "info", shutdown_timeout: float = SHUTDOWN_TIMEOUT_S, **server_options) -> int:
    """Start the engine core, then serve the OpenAI API until SIGTERM/SIGINT (drained: server/shutdown.py; 0)
    or the core dies (1). server_options: build_app's request_body_timeout, max_stop_strings, ..."""
    if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)) or shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be a number of seconds >= 0, got {shutdown_timeout!r}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config, api_key=api_key, served_model_name=served_model_name,
                    trust_request_chat_template=trust_request_chat_template, log_level=log_level, **server_options)
    client: EngineClient = app.state.engine_client
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), client, shutdown_timeout)

    def stop() -> None:
        server.should_exit = True

    client.add_death_callback(stop)
    logger.info("serving %s on http://%s:%d/v1", app.state.server.model_name, host, port)
    freeze_heap()
    server.run()
    if client.is_dead:
        logger.error("exiting: the engine core is gone")
        return 1
    return 0
