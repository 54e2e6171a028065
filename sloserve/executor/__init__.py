"""Executors: how the engine core reaches its workers (``abstract.Executor``; the in-process
``uniproc.UniProcExecutor`` is the default)."""
from __future__ import annotations

from sloserve.config import EngineConfig
from sloserve.executor.abstract import Executor
from sloserve.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for these settings (in-process: the only one so far; vLLM's
    ``Executor.get_class``)."""
    return UniProcExecutor
