"""Fixtures: stub workers and live routers, stopped after each test."""
from __future__ import annotations

import pytest

from sloserve.router.config import RouterConfig

from .stubs import LiveRouter, StubWorker, stop_all


@pytest.fixture
def stub():
    """``stub(name, kv_info=None)``: a started stub worker."""
    started: list[StubWorker] = []

    def make(name: str, kv_info: dict | None = None) -> StubWorker:
        w = StubWorker(name, kv_info).start()
        started.append(w)
        return w

    yield make
    stop_all(started)


@pytest.fixture
def live_router():
    """``live_router(**RouterConfig fields)``: a started router."""
    started: list[LiveRouter] = []

    def make(**kw) -> LiveRouter:
        r = LiveRouter(RouterConfig(**kw)).start()
        started.append(r)
        return r

    yield make
    stop_all(started)
