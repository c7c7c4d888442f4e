"""RequestError: a request refused for what is in it, with the field at fault carried as data; ModelLoadError: a
model folder or file that cannot be loaded.

Front ends (the offline LLM, the server) raise and catch one type; the server answers it as OpenAI's error
JSON with that field as `param` (400), instead of reading the field back out of the message text.
"""
from __future__ import annotations


class RequestError(ValueError):
    """A bad request. param: the field at fault (SamplingParams' or the prompt's name), or None.

    problem: set when the message is "<param> <problem>", so a front end whose request calls the field
    otherwise (chat's max_completion_tokens for max_tokens) can say it under its own name (renamed())."""

    def __init__(self, message: str, param: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.message, self.param, self.problem = message, param, problem

    @classmethod
    def of_field(cls, param: str, problem: str) -> RequestError:
        return cls(f"{param} {problem}", param, problem)

    def renamed(self, param: str) -> RequestError:
        """The same error said of `param` (the request's own name for the field)."""
        if self.problem is None:
            return RequestError(self.message, param)
        return RequestError.of_field(param, self.problem)


class ModelLoadError(ValueError):
    """A model folder or file that cannot be loaded; the message names the file or tensor at fault."""


__all__ = ["RequestError", "ModelLoadError"]
