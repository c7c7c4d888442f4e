"""Prompts in, token ids out: off the event loop, with the cheap refusals first.

Text is tokenized, and the model's chat template rendered, on one worker thread that owns a tokenizer
of its own (the event loop's detokenizer never shares one across threads). The tokenizers library
encodes without holding the GIL, so the event loop keeps streaming meanwhile. Token-id prompts are
only range-checked, which is cheap once their length is known to fit. /tokenize and /detokenize, which take
texts of any length up to the body limit (12 MB took seconds), run on a thread and a tokenizer of their own
(`run_route`), so they never queue a prompt behind them; output constraints are checked on a pool of their own,
within a time budget (server/constraint_check.py).

A text that cannot fit max_model_len is refused before it is tokenized: no token covers more than
`chars_per_token` characters (the longest vocabulary entry, counted in characters; for byte-level BPE
an entry has one character per byte, so it covers at most that many), hence a text of C characters
has at least C / chars_per_token tokens. A normalizer (NFC in Qwen's tokenizer) may compose up to
three characters into one before the model sees them, so the bound is tripled when there is one.
"""
from __future__ import annotations

import asyncio
import copy
import math
from concurrent.futures import ThreadPoolExecutor

from nanoserve.engine.prompts import Prompt, check_prompt_length, tokenize
from nanoserve.errors import RequestError
from nanoserve.server.constraint_check import ConstraintChecker
from nanoserve.server.request_body import APIError

NORMALIZER_SLACK = 3  # characters a normalizer may merge into one (Hangul L+V+T jamo → one syllable)


def chars_per_token_bound(tokenizer) -> int:
    """No token of this tokenizer covers more characters of input text than this."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    has_normalizer = backend is not None and backend.normalizer is not None
    return max(1, longest) * (NORMALIZER_SLACK if has_normalizer else 1)


class Preprocessor:
    """Text and chat prompts → validated token ids, on the tokenizer thread; request templates in a sandbox."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, template_sandbox=None):
        self.tokenizer = tokenizer  # used on the worker thread only
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.sandbox = template_sandbox
        self.chars_per_token = chars_per_token_bound(tokenizer) if tokenizer is not None else 1
        self.max_chars = max_model_len * self.chars_per_token  # longer texts cannot fit
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenizer")
        self._route_executor = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenize-route")
        self._route_tokenizer = None  # the routes' copy, made on their thread at first use
        self.constraints = ConstraintChecker()

    def close(self) -> None:
        for executor in (self._executor, self._route_executor):
            executor.shutdown(wait=False, cancel_futures=True)
        self.constraints.close()
        if self.sandbox is not None:
            self.sandbox.close()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run_route(self, fn, *args):
        """fn(tokenizer, *args) on the tokenize routes' thread, with their tokenizer (a copy of the prompts' one)."""
        return await asyncio.get_running_loop().run_in_executor(self._route_executor, self._with_route_tokenizer,
                                                                fn, args)

    def _with_route_tokenizer(self, fn, args):
        """The copy renders the prompts' chat template, whatever that is now (one template for chat and /tokenize)."""
        if self._route_tokenizer is None:
            self._route_tokenizer = copy.deepcopy(self.tokenizer)
        self._route_tokenizer.chat_template = getattr(self.tokenizer, "chat_template", None)
        return fn(self._route_tokenizer, *args)

    # -- completions -------------------------------------------------------------------------------
    async def completion_prompts(self, prompts: list[Prompt]) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt, in order; APIError(400) for the first that cannot run."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.tokenizer is None:
            raise APIError(400, "This server runs without a tokenizer (skip_tokenizer_init): give prompts as token "
                                "ids.", param="prompt")
        for text in texts:
            self.check_text_length(text, "prompt")
        encoded = iter(await self._run(self._tokenize_all, texts) if texts else ())
        return [next(encoded) if isinstance(p, str) else self._tokenize(p) for p in prompts]

    def _tokenize_all(self, texts: list[str]) -> list[tuple[str | None, list[int]]]:
        return [self._tokenize(t) for t in texts]

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The front end's rule (engine/prompts.tokenize: RequestError on "prompt"), with this thread's tokenizer."""
        return tokenize(self.tokenizer, prompt, self.vocab_size, self.max_model_len)

    def check_text_length(self, text: str, param: str) -> None:
        """The cheap refusal: a text too long to fit max_model_len whatever its tokens."""
        if len(text) > self.max_chars:
            at_least = math.ceil(len(text) / self.chars_per_token)
            raise APIError(400, f"The {param} has at least {at_least} tokens ({len(text)} characters, at most "
                                f"{self.chars_per_token} per token); max_model_len is {self.max_model_len} (the prompt "
                                "must leave room for at least one generated token).", param=param)

    # -- chat --------------------------------------------------------------------------------------
    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, chat_template: str | None = None,
                          tools: list[dict] | None = None) -> list[int]:
        """The conversation rendered by the model's template (or a request's, in the sandbox), as token ids; `tools`
        reach the template as transformers passes them."""
        if self.tokenizer is None:
            raise APIError(400, "Chat needs a tokenizer, and this server runs without one (skip_tokenizer_init).")
        if chat_template is not None:
            text = await self.sandbox.render(messages, chat_template, add_generation_prompt, tools)
            return await self._run(self._encode_rendered, text)
        return await self._run(self._render_and_encode, messages, add_generation_prompt, tools)

    def _render_and_encode(self, messages: list[dict], add_generation_prompt: bool,
                           tools: list[dict] | None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "The model has no chat template: use /v1/completions, or start the server with "
                                "--trust-request-chat-template and pass `chat_template`.", param="chat_template")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors, raise_exception() in templates ("roles must alternate", ...)
            raise APIError(400, f"The chat template could not render these messages: {e}", param="messages") from None
        return self._encode_rendered(text)

    def _encode_rendered(self, text: str) -> list[int]:
        self.check_text_length(text, "rendered chat prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template already holds BOS etc.
        if not ids:
            raise APIError(400, "The chat prompt is empty.", param="messages")
        try:
            check_prompt_length(len(ids), self.max_model_len)
        except RequestError as e:
            raise e.renamed("messages") from None
        return ids


__all__ = ["Preprocessor", "chars_per_token_bound"]
