"""The OpenAI-compatible HTTP server: `build_app()` for an ASGI app, `serve()` for `nanoserve serve`."""
from nanoserve.server.app import build_app, serve
from nanoserve.server.async_engine import AsyncEngine

__all__ = ["build_app", "serve", "AsyncEngine"]
