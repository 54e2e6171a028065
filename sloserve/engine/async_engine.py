"""Async engine: the step loop runs in a background thread; each request streams its outputs.

The forward pass releases the GIL inside torch's kernels, so the asyncio event loop (HTTP server)
stays responsive while the engine thread computes. Adds and aborts cross into the engine thread
through a queue and take effect at the next step boundary (an abort frees the request's KV blocks
before the next step is scheduled).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.metrics import StatLogger
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.request import Request
from sloserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread is not running."""


class AsyncLLM:
    """Async front of LLMEngine.

    Usage:
        engine = AsyncLLM(EngineConfig(...)); engine.start()
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8)): ...
        await engine.abort(request_id)
        engine.shutdown()
    """

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None):
        self.engine = LLMEngine(config, stat_loggers)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # exposed for the server
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sloserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ client side
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Validate and tokenize (raises ParamError) without queueing."""
        return self.engine.make_request(prompt, params, request_id, arrival_time)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request made by make_request and yield its outputs until it finishes.

        Leaving the iteration early (the client went away, the task was cancelled) aborts the
        request and frees its KV blocks.

        Raises:
            EngineDeadError: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid!r}")
            self._streams[rid] = (loop, q)
        self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                out: RequestOutput | Exception = await q.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))

    async def abort(self, request_id: str) -> None:
        """Abort a request (takes effect before the next step)."""
        self._inbox.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # event loop closed
                pass

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                try:
                    self.engine.add(payload)
                except Exception as e:  # duplicate id, over capacity: tell that request only
                    self._deliver(payload.request_id, ValueError(str(e)))
            elif kind == "abort":
                out = self.engine.abort_request(payload)
                if out is not None:
                    self._deliver(payload, out)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not eng.has_unfinished_requests())
                if not eng.has_unfinished_requests():
                    continue
                for out in eng.step():
                    self._deliver(out.request_id, out)
            except Exception:  # never let one bad step kill the loop
                logger.exception("engine loop error")
