"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, serving the embedded
SmolLM2-135M-Instruct in float32; driven with the official `openai` client and httpx."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

import sloserve
from sloserve.config import EngineConfig
from sloserve.engine.async_llm import AsyncLLM
from sloserve.engine.outputs import RequestOutput
from sloserve.sampling_params import SamplingParams
from sloserve.server.app import create_engine_and_app
from sloserve.server.tools import ChatConfig

#: the template shipped for ChatML models with tools (renders exactly as SmolLM2's own without)
HERMES_TEMPLATE = os.path.join(os.path.dirname(sloserve.__file__), "templates",
                               "hermes_chatml.jinja")


@dataclass
class LiveServer:
    engine: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.engine.model_name

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


def start_server(config: EngineConfig, step_trace: str | None = None,
                 chat: ChatConfig | None = None,
                 goodput: dict[str, float] | None = None) -> LiveServer:
    """Build engine + app and serve it with uvicorn on a free port in a daemon thread (the core
    writes its step trace to ``step_trace`` if given; ``chat``: the chat flags; ``goodput``:
    the SLO limits, ms)."""
    engine, app = create_engine_and_app(config, step_trace=step_trace, chat=chat,
                                        goodput=goodput)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.shutdown()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return LiveServer(engine, server, thread, port)


#: the session server's --structured-outputs-compile-timeout (CPU s): every grammar the tests
#: use compiles in milliseconds but the wide schemas of the compile-limit tests
COMPILE_TIMEOUT_S = 1.0


@pytest.fixture(scope="session")
def live_server():
    srv = start_server(EngineConfig(model=None, dtype="float32", num_kv_blocks=512,
                                    max_model_len=2048, max_num_batched_tokens=512,
                                    structured_outputs_compile_timeout=COMPILE_TIMEOUT_S))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine(live_server) -> AsyncLLM:
    return live_server.engine


def openai_client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def http_client(srv: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=srv.base_url, timeout=120)


@pytest.fixture(scope="session")
def client(live_server) -> openai.OpenAI:
    return openai_client(live_server)


@pytest.fixture(scope="session")
def http(live_server):
    with http_client(live_server) as c:
        yield c


def engine_generate(engine: AsyncLLM, prompt: str | list[int],
                    params: SamplingParams) -> list[RequestOutput]:
    """Run one request straight through the AsyncLLM (from the test thread); all its outputs."""

    async def go():
        req = engine.make_request(prompt, params)
        return [o async for o in engine.generate(req)]

    return asyncio.run(go())


def wait_all_blocks_free(engine: AsyncLLM, timeout: float = 60.0) -> float:
    """Poll the engine core's published snapshot until every KV block is free and no request is
    left (``timeout``: a hang guard, not a speed bound); returns the seconds it took.

    Raises AssertionError on timeout (with the numbers)."""
    t0 = time.monotonic()
    while True:
        s = engine.stats
        if (s.num_free_blocks == s.num_blocks and not s.num_running and not s.num_waiting
                and not engine.num_unfinished):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(
                f"after {timeout}s: {s.num_free_blocks}/{s.num_blocks} KV blocks free, "
                f"{s.num_running} running, {s.num_waiting} waiting, "
                f"{engine.num_unfinished} unfinished in the front end")
        time.sleep(0.01)


def wait_healthy(proc, base: str, log_path, timeout: float = 120) -> None:
    """Poll a ``sloserve serve`` subprocess's /health until 200. Raises AssertionError (with the
    server's log) if it exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, open(log_path).read()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not get healthy"
        time.sleep(0.2)


def sse_events(lines) -> list[str]:
    """The `data:` payloads of an SSE line iterator (httpx iter_lines)."""
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


@pytest.fixture(scope="session")
def helpers():
    """The helper functions above, as a fixture (test modules need not import conftest)."""

    class H:
        generate = staticmethod(engine_generate)
        wait_all_blocks_free = staticmethod(wait_all_blocks_free)
        sse_events = staticmethod(sse_events)
        start_server = staticmethod(start_server)
        wait_healthy = staticmethod(wait_healthy)
        hermes_template = HERMES_TEMPLATE
        #: a small server's settings (its own tests' servers)
        small_config = EngineConfig(model=None, dtype="float32", num_kv_blocks=64,
                                    max_model_len=512, max_num_batched_tokens=128)
        openai_client = staticmethod(openai_client)
        http_client = staticmethod(http_client)

    return H
