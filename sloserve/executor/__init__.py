"""Executors: how the engine core reaches its workers (``abstract.Executor``; the in-process
``uniproc.UniProcExecutor`` is the default, ``ray.RayExecutor`` puts the worker in a Ray
actor)."""
from __future__ import annotations

from sloserve.config import EngineConfig
from sloserve.executor.abstract import Executor
from sloserve.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for these settings (vLLM's ``Executor.get_class``): in-process, or
    the worker in a Ray actor (``--distributed-executor-backend ray``)."""
    if config.distributed_executor_backend == "ray":
        from sloserve.executor.ray import RayExecutor
        return RayExecutor
    return UniProcExecutor
