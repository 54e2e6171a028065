"""Structured-output specs checked in a helper process, so that the API's event loop never waits
for one.

The front end answers a spec that cannot compile with a 400 before it streams anything
(:func:`sloserve.engine.structured_output.validate`). That check parses the spec with xgrammar,
which holds the GIL while its C++ parses (a 2,000-property JSON schema: 15-75 ms) and loads
torch when it is imported: in the API process, even on a worker thread, every stream the
process serves stopped for that long (issue 33's grammar-interference benchmark: gaps of
~100 ms), and the process that must not import torch did. :class:`SpecChecker` runs the check
in one child process (spawned at the first structured request, spawned again if it dies); the
calling thread waits for its verdict without the GIL. The child loads xgrammar at the priority
it was started with, then checks at nice :data:`NICE` (as the compile worker does: loading at a
low priority on a busy host takes minutes).
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from sloserve.engine import structured_output
from sloserve.engine.grammar_worker import lower_priority, watch_parent
from sloserve.sampling_params import StructuredOutputsParams

#: the checking process's niceness: below the engine core's step loop, above the compiles (19)
NICE = 10


def _load_then_lower_priority(nice: int, parent_pid: int) -> None:
    watch_parent(parent_pid)  # (a server killed, or an app never shut down: no orphan left)
    structured_output.validate(StructuredOutputsParams(regex="a"))  # imports xgrammar
    lower_priority(nice)


class SpecChecker:
    """Checks structured-output specs in a child process (module docstring). Thread-safe."""

    def __init__(self, nice: int = NICE):
        self._nice = nice
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the spec checker is closed")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_load_then_lower_priority, initargs=(self._nice, os.getpid()))
            return self._pool

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Block until the child has checked ``spec``.

        Raises:
            ValueError: the spec cannot compile (``validate``'s message), or its parse killed
                the checking process twice (it is started again for the next request).
        """
        for _ in range(2):  # a crash may be another request's: one retry on a new child
            pool = self._executor()
            try:
                return pool.submit(structured_output.validate, spec).result()
            except BrokenProcessPool:
                self._drop(pool)
        raise ValueError("the structured-output spec crashed the grammar parser")

    def warm(self) -> None:
        """Start the child now (a background thread; nothing waits for it), so the first
        structured request does not pay for it: on a 2-core host, spawning it and importing
        xgrammar at normal priority starved the server for 2-4 s while requests were in flight
        (a router's 1 s health check then took the server for dead). Without xgrammar the
        child's start fails and the first request finds that out, as before."""
        def run():
            try:
                self.check(StructuredOutputsParams(regex="a"))
            except Exception:  # no xgrammar, or closed meanwhile: the first request says so
                pass
        threading.Thread(target=run, name="spec-checker-warm", daemon=True).start()

    def close(self) -> None:
        """Stop the child; checks still waiting for it fail (their futures are cancelled, and
        a retry finds the checker closed)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
