"""OpenAI request bodies (pydantic) and the error body.

Types are strict ("5" is not an int, 1.5 is not an int) and unknown fields are rejected with a 400
naming the field, as api.openai.com does; value ranges are checked once, by SamplingParams.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.sampling import MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM extras)."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as an end-user id is only for abuse tracking

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments this request sets (unset ones keep SamplingParams' defaults)."""
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                 "skip_special_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        msg = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated OpenAI name; max_completion_tokens wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # checked here: SamplingParams calls it logprobs
    chat_template: str | None = None  # a Jinja template for models without one (or to override it)
    add_generation_prompt: bool = True


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
