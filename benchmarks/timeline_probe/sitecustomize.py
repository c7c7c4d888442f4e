"""Loaded by `benchmarks/serve_timeline.py` into `nanoserve serve`'s processes (PYTHONPATH): timestamps where a
request passes (API entry, submission, the core's inputs / steps / sends, delivery back in the API) and garbage
collections of 1 ms or more, one file per
process under $NANOSERVE_TIMELINE_DIR. Nothing is imported or changed unless that variable is set."""
import gc
import importlib.abc
import importlib.util
import inspect
import os
import sys
import time

TARGETS = {  # module → (class, method, label)
    "nanoserve.server.handlers": [("OpenAIServer", "completions", "api.handler"), ("OpenAIServer", "submit", "api.submit")],
    "nanoserve.server.client": [("EngineClient", "_deliver", "api.deliver")],
    "nanoserve.engine.core_process": [("CoreLoop", "_handle_inputs", "core.inputs"), ("CoreLoop", "send", "core.send")],
    "nanoserve.engine.core": [("EngineCore", "step", "core.step"), ("EngineCore", "add_request", "core.add")],
}


def _install(directory: str) -> None:
    log = open(os.path.join(directory, f"{os.getpid()}.log"), "a", buffering=1)

    def mark(label: str) -> None:
        log.write(f"{time.perf_counter() * 1e3:.3f} {label}\n")

    def wrapped(f, label):
        if inspect.iscoroutinefunction(f):
            async def g(*a, **k):
                mark(label + ">")
                try:
                    return await f(*a, **k)
                finally:
                    mark(label + "<")
        else:
            def g(*a, **k):
                mark(label + ">")
                try:
                    return f(*a, **k)
                finally:
                    mark(label + "<")
        return g

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for cls, method, label in TARGETS[name]:
                    c = getattr(module, cls)
                    setattr(c, method, wrapped(getattr(c, method), label))
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
    started = {}

    def collection(phase, info):  # garbage collections of 1 ms or more, and every full one
        if phase == "start":
            started["t"] = time.perf_counter()
            return
        ms = (time.perf_counter() - started.get("t", time.perf_counter())) * 1e3
        if ms >= 1 or info["generation"] == 2:
            mark(f"gc{info['generation']} {ms:.2f}ms")

    gc.callbacks.append(collection)


if os.environ.get("NANOSERVE_TIMELINE_DIR"):
    _install(os.environ["NANOSERVE_TIMELINE_DIR"])
