"""SSEResponse: server-sent events that notice the client leaving, whatever the ASGI spec version."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse


class SSEResponse(StreamingResponse):
    """A disconnect cancels the body iterator; on_close (which aborts the engine request) always runs."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
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
