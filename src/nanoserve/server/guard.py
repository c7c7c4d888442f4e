"""The server's one gate, in front of every route (an ASGI middleware): the same rules for /v1, /tokenize and any
route added later, so no route can sit outside them.

In this order, each answered in OpenAI's error format before the route runs:
- a browser's cross-origin request (an `Origin` that is neither this server's own nor in --allowed-origins) is 403:
  a web page cannot drive a local server through its user's browser (CORS preflights for the allowed origins are
  answered by Starlette's CORSMiddleware, outside this one);
- the API key (--api-key) on every route but the probes (/health, /ping, /version, /metrics, as vLLM's): 401;
- a body sent as anything but JSON (text/plain, a form, multipart: what a page may send without a preflight) to a
  route that reads JSON is 415; no Content-Type at all is read as JSON, as FastAPI does;
- a body larger than MAX_BODY_BYTES (declared or as it arrives) is 413, and one not received in full within the body
  timeout of the request's start is 408 with the connection closed (a client dribbling its body cannot hold a
  socket).
Responses of the guarded routes are counted by status code.
"""
from __future__ import annotations

import asyncio
import json
import secrets

from nanoserve.config import REQUEST_BODY_TIMEOUT_S
from nanoserve.server.handlers import json_response
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.request_body import APIError, error_body

MAX_BODY_BYTES = 32 * 2**20  # a 32k-token prompt as token ids is ~0.3 MiB of JSON
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})  # probes: no key, no body
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


def too_large() -> APIError:
    return APIError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")


def is_json_type(content_type: str) -> bool:
    """application/json, with parameters (charset) or as a +json suffix; an absent type counts as JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or (media.startswith("application/") and media.endswith("+json"))


def parse_origins(values: list[str] | None) -> frozenset[str]:
    """--allowed-origins as vLLM takes it (one JSON list, '["http://a", "http://b"]') or as separate values."""
    origins: list[str] = []
    for value in values or ():
        value = value.strip()
        items = json.loads(value) if value.startswith("[") else [value]
        if not all(isinstance(o, str) for o in items):
            raise ValueError(f"--allowed-origins takes origins such as http://localhost:3000, got {value!r}")
        origins += [o.rstrip("/") for o in items]
    return frozenset(origins)


class RequestGuard:
    def __init__(self, app, api_key: str | None, metrics: ServerMetrics,
                 body_timeout: float = REQUEST_BODY_TIMEOUT_S, allowed_origins: frozenset[str] = frozenset()):
        self.app, self.api_key, self.metrics, self.body_timeout = app, api_key, metrics, body_timeout
        self.allowed_origins = allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        error = self._refusal(scope, headers)
        if scope["path"] in OPEN_PATHS:
            if error is not None:
                return await _answer(error, scope, receive, send)
            return await self.app(scope, self._limited(receive), send)
        status = 500  # what the outer ServerErrorMiddleware answers if the app raises

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if error is not None:
                return await _answer(error, scope, receive, counting_send)
            await self.app(scope, self._limited(receive), counting_send)
        finally:
            self.metrics.requests.labels(str(status)).inc()

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        """Why the request is refused before its route runs, or None."""
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/")
        if origin and not self._origin_allowed(origin, scope, headers):
            return APIError(403, f"Cross-origin request refused: the origin {origin!r} is not allowed (start the "
                                 "server with --allowed-origins to allow it).", code="origin_not_allowed")
        if scope["path"] in OPEN_PATHS:
            return None
        if self.api_key is not None and not self._authorized(headers):
            return APIError(401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
                            code="invalid_api_key")
        if scope["method"] in BODY_METHODS:
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            if not is_json_type(content_type):
                return APIError(415, f"The request body must be JSON (Content-Type: application/json), not "
                                     f"{content_type.split(';', 1)[0].strip()!r}.", code="unsupported_media_type")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return too_large()
        return None

    def _origin_allowed(self, origin: str, scope, headers: dict[bytes, bytes]) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        host = headers.get(b"host", b"").decode("latin-1")
        return bool(host) and origin == f"{scope.get('scheme', 'http')}://{host}"  # the server's own pages

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        header = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    def _limited(self, receive):
        """`receive` with the size limit and the body deadline (bodies sent chunked are counted as they come)."""
        received, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # only a disconnect can follow: no deadline on waiting for it
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout() from None
            received += len(message.get("body", b""))
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if received > MAX_BODY_BYTES:
                raise BodyTooLarge()
            return message
        return limited_receive


async def _answer(error: APIError, scope, receive, send) -> None:
    await json_response(error_body(error.message, error.type, error.param, error.code),
                        status=error.status)(scope, receive, send)


__all__ = ["MAX_BODY_BYTES", "OPEN_PATHS", "BodyTimeout", "BodyTooLarge", "RequestGuard", "parse_origins"]
