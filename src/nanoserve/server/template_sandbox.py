"""Chat templates sent in requests, rendered in a process that can be killed.

A Jinja template from a request is code from a stranger: Jinja's sandbox stops it from touching the
system, but not from looping for minutes or building a string of gigabytes, and a thread cannot be
stopped. So it renders in a child process (spawn) that holds the model's tokenizer (templates see the
same special tokens as the model's own), under an address-space limit; a render that outlives the time
limit is ended by killing the process, which is replaced before the next render. The rendered text is
capped at max_chars (what could still fit max_model_len). One render at a time.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

from nanoserve.server.request_body import APIError

DEFAULT_TIMEOUT_S = 5.0
MEMORY_HEADROOM_BYTES = 2 * 2**30  # what a render may allocate beyond the worker's size once loaded
START_TIMEOUT_S = 120.0


class TemplateSandbox:
    def __init__(self, tokenizer_path: str, max_chars: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.tokenizer_path, self.max_chars, self.timeout_s = tokenizer_path, max_chars, timeout_s
        self._process = self._conn = None
        self._lock: asyncio.Lock | None = None
        self.start()

    def start(self) -> None:
        """(Re)start the worker and wait until its tokenizer is loaded (blocking)."""
        spawn = multiprocessing.get_context("spawn")
        parent, child = spawn.Pipe()
        process = spawn.Process(target=_serve, args=(child, self.tokenizer_path, self.max_chars),
                                name="nanoserve-template-sandbox", daemon=True)
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            raise RuntimeError("the chat-template sandbox did not start")
        status, detail = parent.recv()
        if status != "ready":
            process.join(5)
            raise RuntimeError(f"the chat-template sandbox did not start: {detail}")
        self._process, self._conn = process, parent

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    async def render(self, messages: list[dict], template: str, add_generation_prompt: bool,
                     tools: list[dict] | None = None) -> str:
        """The rendered prompt text, or APIError(400): the template failed, ran too long, or rendered too much."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            loop = asyncio.get_running_loop()
            if not self._process.is_alive():
                await loop.run_in_executor(None, self.start)
            self._conn.send((messages, template, add_generation_prompt, tools))
            if not await self._answered(loop):
                self._process.kill()  # a thread could not be stopped; a process can
                await loop.run_in_executor(None, self._process.join)
                raise APIError(400, f"The chat template did not render within {self.timeout_s:g} s.",
                               param="chat_template")
            status, detail = self._conn.recv()
        if status == "too_long":
            raise APIError(400, f"The chat template rendered {detail} characters; max_model_len cannot hold more "
                                f"than {self.max_chars}.", param="chat_template")
        if status != "ok":
            raise APIError(400, f"The chat template could not render these messages: {detail}", param="chat_template")
        return detail

    async def _answered(self, loop) -> bool:
        ready = loop.create_future()
        fd = self._conn.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, self.timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)


def _limit_memory(headroom: int) -> None:
    """Cap the address space at its current size + headroom: a huge string raises MemoryError here."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):  # not Linux: the time limit still holds
        pass


def _serve(conn, tokenizer_path: str, max_chars: int) -> None:
    """The worker: render (messages, template, add_generation_prompt, tools) jobs until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the server's drain may still render; it is killed at close
    try:
        from nanoserve.model_files import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    _limit_memory(MEMORY_HEADROOM_BYTES)
    conn.send(("ready", None))
    while True:
        try:
            messages, template, add_generation_prompt, tools = conn.recv()
        except EOFError:
            return
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            answer = ("too_long", len(text)) if len(text) > max_chars else ("ok", text)
        except MemoryError:
            answer = ("error", "it needed more memory than a chat template may use")
        except Exception as e:  # jinja syntax errors, raise_exception(), undefined names, ...
            answer = ("error", str(e) or type(e).__name__)
        conn.send(answer)


__all__ = ["TemplateSandbox"]
