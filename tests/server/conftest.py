"""A real uvicorn server on 127.0.0.1 (free port, background thread) over a tiny random model, its engine
core in a process of its own, shared by the server tests; plus an offline LLM on the same folder as the
reference for greedy outputs, and helpers to freeze the core process (SIGSTOP) or read its CPU time."""
from __future__ import annotations

import pytest

# The GPU image has neither the openai client nor uvicorn: there these tests are skipped (CPU CI runs them).
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import contextlib  # noqa: E402
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from nanoserve import LLM
from nanoserve.server.app import build_app

ARCH = "qwen3"
ENGINE_OPTIONS = dict(device="cpu", max_num_seqs=64, max_model_len=256, num_kv_blocks=1024, show_progress=False)
API_KEY = "sk-test-key"
MODEL = "tiny"


def start_uvicorn(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Serve `app` from a thread on a socket bound here (port 0: no race for a free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@dataclass
class LiveServer:
    app: object
    base_url: str
    model: str = MODEL
    api_key: str = API_KEY

    @property
    def engine_client(self):
        return self.app.state.engine_client

    @property
    def prompt_tokenizer(self):
        """The tokenizer the server renders chat templates and tokenizes prompts with (its worker thread's)."""
        return self.app.state.server.preprocessor.tokenizer

    @property
    def core_pid(self) -> int:
        return self.engine_client.core_pid

    @contextlib.contextmanager
    def core_frozen(self):
        """The engine core process stopped (SIGSTOP) for the block: it neither steps nor reads its input."""
        os.kill(self.core_pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.core_pid, signal.SIGCONT)

    def core_cpu_seconds(self) -> float:
        """user + system CPU time of the engine core process so far (Linux /proc)."""
        with open(f"/proc/{self.core_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0, timeout=60, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0, timeout=60)

    def http(self, auth: bool = True) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if auth else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics parsed with prometheus_client's own parser: (sample name, sorted labels) → value."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request and no KV block (stats as of the core's last message)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine_client.stats
            if s.num_running == s.num_waiting == s.kv_blocks_used == 0 and \
                    not self.engine_client.has_unfinished_requests():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {s}")
            time.sleep(0.02)

    @staticmethod
    def metric(snapshot: dict, name: str, **labels) -> float:
        """One sample of a metrics() snapshot (0 when absent)."""
        return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="package")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs[ARCH])


def stop_uvicorn(app, server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(30)
    client = app.state.engine_client
    assert not client.is_running and not client.core_client.process.is_alive(), "the engine core must stop with the server"


@pytest.fixture(scope="package")
def live(model_dir):
    app = build_app(model_dir, api_key=API_KEY, served_model_name=MODEL, **ENGINE_OPTIONS)
    server, thread, base_url = start_uvicorn(app)
    try:
        yield LiveServer(app, base_url)
    finally:
        stop_uvicorn(app, server, thread)


@pytest.fixture(scope="module")
def serve_app():
    """serve_app(app) → LiveServer for an app of the module's own (stopped when the module ends)."""
    started = []

    def start(app) -> LiveServer:
        server, thread, base_url = start_uvicorn(app)
        started.append((app, server, thread))
        return LiveServer(app, base_url)

    yield start
    for app, server, thread in started:
        stop_uvicorn(app, server, thread)


@pytest.fixture(scope="package")
def offline(model_dir) -> LLM:
    """The offline API on the same model folder: the reference for greedy outputs."""
    return LLM(model_dir, **ENGINE_OPTIONS)


@dataclass
class ServeProcess:
    """`nanoserve serve` in a subprocess, as a user runs it (its log goes to a file)."""

    proc: subprocess.Popen
    base_url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def core_pid(self) -> int:
        found = re.search(r"engine core ready in [\d.]+ s \(pid (\d+)\)", self.log())
        assert found, self.log()
        return int(found.group(1))

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve_process(model_dir: str, log_path, *flags: str, timeout: float = 120,
                        new_session: bool = False, env: dict[str, str] | None = None) -> ServeProcess:
    """Start `nanoserve serve --model model_dir *flags` on a free port and wait for /health. new_session: in a
    process group of its own (signal it as a terminal's Ctrl-C does, os.killpg); env: variables added to ours (limits
    read from the environment, such as NANOSERVE_GRAMMAR_MAX_BYTES)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve", "serve", "--model", model_dir, "--port", str(port), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=new_session)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", str(log_path))
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, server.log()
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise AssertionError(f"nanoserve serve did not come up:\n{server.log()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
    """serve_process(model_dir, *flags, env=...) → a running ServeProcess (killed at the end of the module if still
    up)."""
    started: list[ServeProcess] = []

    def start(model_dir: str, *flags: str, new_session: bool = False,
              env: dict[str, str] | None = None) -> ServeProcess:
        server = start_serve_process(model_dir, tmp_path_factory.mktemp("serve") / "serve.log", *flags,
                                     new_session=new_session, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(signal.SIGKILL)
