"""OpenAI request bodies: decoding (msgspec), the one-line error a malformed or invalid body gets, and the error
format; the fields accepted and ignored.

A body is decoded by msgspec, which refuses what is not JSON that Python can hold faithfully: lone
UTF-16 surrogates ("\\ud800", anywhere: a prompt, a model name, a key), numbers out of range (1e999),
NaN/Infinity, invalid UTF-8. It is also about twice as fast as the standard library on a large body,
which matters because decoding runs on the event loop. Pydantic then checks the shape (server/protocol.py's models).
"""
from __future__ import annotations

import logging
import mmap
import re

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError

# a \uD800-\uDFFF escape that is not half of a pair (after an even run of backslashes, so a real escape)
_LONE_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*"
    rb"(?:\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})")


_TOO_DEEP = "The request body nests arrays or objects too deeply to be a request."
logger = logging.getLogger("nanoserve.server")

# Fields current OpenAI SDKs and agent frameworks send that change nothing here: accepted and ignored, as vLLM does
# (each name logged once). Fields this server honours keep their checks.
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "reasoning_effort", "modalities", "prompt_cache_key",
                            "safety_identifier", "verbosity", "user"})
_logged_ignored: set[str] = set()


def without_ignored(data, ignored: frozenset[str] = IGNORED_FIELDS):
    """The request body less the fields accepted and ignored (logged once per field name)."""
    if not isinstance(data, dict) or ignored.isdisjoint(data):
        return data
    for name in ignored.intersection(data) - _logged_ignored:
        _logged_ignored.add(name)
        logger.info("request field %r is accepted and ignored (logged once)", name)
    return {k: v for k, v in data.items() if k not in ignored}


class APIError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_body(raw, model: type[BaseModel]) -> BaseModel:
    """The request body (bytes or any buffer) as `model`, or an APIError(400) saying what is wrong in one line."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, _json_error(raw, e)) from None
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    try:
        return model.model_validate(data)
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise APIError(400, message, param=param) from None


def _json_error(raw, e: Exception) -> str:
    lone = _LONE_SURROGATE.search(raw)
    if lone is not None:
        escape = lone.group()[-6:].decode()
        return (f"The request body is not valid JSON: it contains a lone UTF-16 surrogate ({escape}); text must be "
                "valid Unicode (a surrogate escape is only valid as half of a pair).")
    text = str(e)
    if "out of range" in text:
        return "The request body is not valid JSON: a number is out of range (numbers must be finite)."
    return f"The request body is not valid JSON: {text}."


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error belongs to in `loc`: 'str', 'list[int]', 'TextPart', ..."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper())


def validation_message(errors) -> tuple[str, str | None]:
    """pydantic errors → one readable line and the first offending parameter. A value that fits no member
    of a union (prompt, stop, content) gets one line listing the accepted forms."""
    parts: dict[str, list[str]] = {}  # field path → messages
    forms: dict[str, list[str]] = {}  # field path → union members tried
    for err in errors:
        loc = [x for x in err.get("loc", ()) if x != "body"]
        tags = [i for i, x in enumerate(loc) if _is_union_tag(x)]
        path = ".".join(str(x) for x in (loc[:tags[0]] if tags else loc))
        if tags:
            forms.setdefault(path, []).append(loc[tags[0]])
        if err.get("type") == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {path}"
        elif err.get("type") == "value_error":  # our own validators say "field: message"
            text = str(err.get("ctx", {}).get("error", err.get("msg")))
            field, sep, rest = text.partition(": ")
            if sep:
                path, text = ".".join(filter(None, (path, field))), rest
            msg = f"{path}: {text}" if path else text
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


LARGE_BODY_BYTES = 1 << 20


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready (its request was aborted)."""


async def read_body(request: Request) -> bytes | mmap.mmap:
    """The body, copied chunk by chunk into one buffer of its declared length. A large body goes into an
    anonymous memory map, whose pages are touched as chunks arrive: neither a final join nor zeroing a big
    buffer up front holds the event loop for one long stretch."""
    length = request.headers.get("content-length", "")
    if not length.isdigit() or int(length) < LARGE_BODY_BYTES:
        return await request.body()
    body = mmap.mmap(-1, int(length))
    async for chunk in request.stream():
        body.write(chunk)
    if body.tell() != len(body):  # the client went away mid-body
        raise ClientGone()
    return body


async def parse_request(request: Request, model):
    raw = await read_body(request)
    try:
        return parse_body(raw, model)
    finally:
        if isinstance(raw, mmap.mmap):
            raw.close()


__all__ = ["APIError", "error_body", "parse_body", "parse_request", "read_body", "ClientGone", "validation_message",
           "without_ignored", "IGNORED_FIELDS"]
