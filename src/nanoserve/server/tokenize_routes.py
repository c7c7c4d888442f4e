"""The small routes a vLLM user reaches for, with vLLM's shapes: GET /version, GET|POST /ping, POST /tokenize
(a prompt, or chat messages and tools rendered by the model's template) and POST /detokenize.

Like vLLM's, they live outside /v1; they take the API key, the body limits and the JSON rule as every route does
(server/guard.py; only /version and /ping are open). Tokenizing runs off the event loop on the routes' own thread
and tokenizer (Preprocessor.run_route: a long text here never delays a prompt), which also writes the answer's JSON
(a list of millions of ids is seconds of work for the event loop's encoder); a tokenize request is not refused for being longer than max_model_len (it answers `count`
and `max_model_len`, so a client can check before it sends).
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from nanoserve import __version__
from nanoserve.engine.prompts import check_token_ids
from nanoserve.server.request_body import parse_request
from nanoserve.server.protocol import ChatMessage, ToolDefinition, _Strict, tools_for_template
from nanoserve.server.request_body import APIError


class TokenizeRequest(_Strict):
    """vLLM's two forms in one: a `prompt`, or chat `messages` (+ the template options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = None  # given to the template, as in a chat request
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has BOS)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either `prompt` or `messages`")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("continue_final_message: cannot be true together with add_generation_prompt")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, server) -> None:
    """server: the OpenAIServer (its model name, preprocessor and engine limits)."""

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse_request(request, TokenizeRequest)
        _check_tokenizer(server, body.model)
        answer = await server.preprocessor.run_route(_tokenize_answer, body, server.client.config.max_model_len)
        return Response(answer, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse_request(request, DetokenizeRequest)
        _check_tokenizer(server, body.model)
        check_token_ids(body.tokens, server.client.vocab_size, "tokens")  # a RequestError: 400 naming `tokens`
        return {"prompt": await server.preprocessor.run_route(lambda tokenizer: tokenizer.decode(body.tokens))}


def _check_tokenizer(server, model: str | None) -> None:
    if model is not None:
        server.check_model(model)
    if server.preprocessor.tokenizer is None:
        raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init).")


def _tokenize_answer(tokenizer, body: TokenizeRequest, max_model_len: int) -> bytes:
    """On the routes' thread: the answer's JSON."""
    ids = _encode(tokenizer, body)
    return json.dumps({"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                       "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None},
                      ensure_ascii=False, separators=(",", ":")).encode()


def _encode(tokenizer, body: TokenizeRequest) -> list[int]:
    """The prompt's ids, or the rendered conversation's."""
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "The model has no chat template: tokenize a `prompt` instead.", param="messages")
    try:
        text = tokenizer.apply_chat_template([m.for_template() for m in body.messages],
                                             tools=tools_for_template(body.tools), tokenize=False,
                                             add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message)
    except Exception as e:  # jinja errors, raise_exception() in templates
        raise APIError(400, f"The chat template could not render these messages: {e}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


__all__ = ["add_tokenize_routes"]
