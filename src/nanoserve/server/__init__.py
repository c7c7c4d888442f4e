"""The OpenAI-compatible server: `build_app()` for an ASGI app, `serve()` for `nanoserve serve`; the engine
core runs in its own process behind an `EngineClient`."""
from nanoserve.server.app import build_app, serve
from nanoserve.server.client import EngineClient, EngineStartError

__all__ = ["build_app", "serve", "EngineClient", "EngineStartError"]
