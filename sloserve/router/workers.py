"""The workers behind the router and their health.

Each worker's ``GET /health`` is polled every ``health_check_interval`` seconds (a poll may
take ``health_check_timeout``). A worker is

    healthy     its last poll answered 200: it takes new requests
    unhealthy   its last poll answered something else (a server draining or stalled says 503):
                no new requests; those in flight go on (it is alive and finishing them)
    down        a poll, or a connection for a request, could not reach it (refused, reset,
                timed out): no new requests, and every request in flight on it fails at once
                with a 502 (an error event in a stream already under way)
    unknown     not polled yet

so a worker that dies fails its requests within interval + timeout (1.5 s by default) even when
its connections hang rather than break; one that is killed fails them at once (the
connections break). A worker rejoins when its ``/health`` answers 200 again. A request whose
connection breaks mid-way fails alone and has the worker polled at once.

Every state lives on the event loop's thread; nothing here locks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from sloserve.router.errors import RouterError

logger = logging.getLogger("sloserve.router")

HEALTHY, UNHEALTHY, DOWN, UNKNOWN = "healthy", "unhealthy", "down", "unknown"


@dataclass(eq=False)
class Worker:
    """One server behind the router.

    Attributes:
        url: its base URL (``http://host:port``).
        role: ``replica``, ``prefill`` or ``decode``.
        state: see the module docstring; ``reason`` says why it is not healthy.
        inflight: the requests on it now (``upstream.Upstream``: each can be failed).
        kv_info: its ``GET /kv_transfer`` answer (disaggregated serving), once healthy.
        index: its place in its role's list.
    """

    url: str
    role: str
    index: int = 0
    state: str = UNKNOWN
    reason: str = "not polled yet"
    inflight: set = field(default_factory=set)
    kv_info: dict | None = None
    changed_at: float = field(default_factory=time.monotonic)

    @property
    def outstanding(self) -> int:
        """Requests in flight on it."""
        return len(self.inflight)

    @property
    def available(self) -> bool:
        return self.state == HEALTHY

    def describe(self) -> dict:
        d = {"url": self.url, "role": self.role, "state": self.state,
             "outstanding": self.outstanding,
             "since_s": round(time.monotonic() - self.changed_at, 3)}
        if self.state != HEALTHY:
            d["reason"] = self.reason
        if self.kv_info is not None:
            d["kv_transfer"] = self.kv_info
        return d


class WorkerPool:
    """The workers and their health polls.

    Args:
        workers: every worker, all roles.
        client: the HTTP client for polls (its own, so proxied requests never delay them).
        interval, timeout: seconds between polls of a worker, and a poll's limit.
        want_kv_info: read ``GET /kv_transfer`` of each worker when it becomes healthy.
        on_down: called with a worker when it is marked down (after its requests failed).
        on_state: called with a worker after any change of its state (metrics).
    """

    def __init__(self, workers: list[Worker], client: httpx.AsyncClient, interval: float,
                 timeout: float, want_kv_info: bool = False,
                 on_down: Callable[[Worker], None] | None = None,
                 on_state: Callable[[Worker], None] | None = None):
        self.workers = workers
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.want_kv_info = want_kv_info
        self.on_down = on_down
        self.on_state = on_state
        self._wake: dict[Worker, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []

    def role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def available(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.available]

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Poll every worker once (so the router starts knowing who is up), then keep polling."""
        await asyncio.gather(*(self.probe(w) for w in self.workers))
        for w in self.workers:
            self._wake[w] = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._poll(w), name=f"health {w.url}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _poll(self, w: Worker) -> None:
        wake = self._wake[w]
        while True:
            try:
                await asyncio.wait_for(wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            wake.clear()
            try:
                await self.probe(w)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the polls
                logger.exception("health poll of %s failed", w.url)

    def probe_soon(self, w: Worker) -> None:
        """Poll ``w`` now rather than at its next turn (its connection just broke)."""
        ev = self._wake.get(w)
        if ev is not None:
            ev.set()

    async def probe(self, w: Worker) -> None:
        """One ``/health`` poll of ``w`` and the state it leads to."""
        try:
            r = await asyncio.wait_for(self.client.get(w.url + "/health", timeout=self.timeout),
                                       self.timeout)
        except (httpx.HTTPError, asyncio.TimeoutError, OSError) as e:
            self.mark_down(w, f"/health: {_describe(e, self.timeout)}")
            return
        if r.status_code == 200:
            await self.mark_healthy(w)
        else:
            self.mark_unhealthy(w, f"/health answered {r.status_code}")

    # ------------------------------------------------------------------ states
    def _set(self, w: Worker, state: str, reason: str) -> bool:
        if w.state == state and w.reason == reason:
            return False
        old = w.state
        w.state, w.reason = state, reason
        if old != state:
            w.changed_at = time.monotonic()
            log = logger.info if state == HEALTHY else logger.warning
            log("worker %s (%s): %s -> %s%s", w.url, w.role, old, state,
                "" if state == HEALTHY else f" ({reason})")
        if self.on_state is not None:
            self.on_state(w)
        return old != state

    def mark_down(self, w: Worker, reason: str) -> None:
        """``w`` cannot be reached: no new requests, and each in flight fails now."""
        changed = self._set(w, DOWN, reason)
        if w.inflight:
            err = RouterError(502, f"worker {w.url} went down ({reason})", "worker_down")
            for u in list(w.inflight):
                u.fail(err)
        if changed:
            w.kv_info = None
            if self.on_down is not None:
                self.on_down(w)

    def mark_unhealthy(self, w: Worker, reason: str) -> None:
        """``w`` answers but not 200: no new requests; those in flight go on."""
        self._set(w, UNHEALTHY, reason)

    async def mark_healthy(self, w: Worker) -> None:
        if w.state != HEALTHY and self.want_kv_info:
            await self.fetch_kv_info(w)
        self._set(w, HEALTHY, "")

    async def fetch_kv_info(self, w: Worker) -> dict | None:
        """``GET /kv_transfer`` of ``w`` (kept in ``w.kv_info``; None when it has none)."""
        try:
            r = await asyncio.wait_for(
                self.client.get(w.url + "/kv_transfer", timeout=self.timeout), self.timeout)
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, asyncio.TimeoutError, OSError, ValueError) as e:
            logger.warning("worker %s: GET /kv_transfer failed: %s", w.url,
                           _describe(e, self.timeout))
            info = None
        if info is not None and not isinstance(info, dict):
            info = None
        w.kv_info = info
        return info


def _describe(e: BaseException, timeout: float) -> str:
    if isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException)):
        return f"no answer within {timeout:g} s"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
