"""The executor interface: the engine core's one seam to the workers that hold the model and
its KV cache (vLLM's ``Executor``).

The core asks the executor for the KV cache spec and the memory the cache may take, sizes the
cache (``EngineConfig.resolve_kv_cache``), has it allocated (:meth:`Executor.initialize_cache`)
and then hands it one scheduler output per step (:meth:`Executor.execute_model`), all plain data
(``sloserve.step_io``). :class:`~sloserve.executor.uniproc.UniProcExecutor` runs one worker in
the core's process; a multi-process or Ray executor (one worker per process or node) and a KV
connector's worker half implement the same methods, each through :meth:`Executor.collective_rpc`
(call a worker method on every worker, results in rank order). No torch here.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

from sloserve.config import EngineConfig
from sloserve.kv_cache_spec import KVCacheSpec
from sloserve.step_io import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput, WorkerInfo


class WorkerLostError(RuntimeError):
    """A worker died and was replaced (a Ray actor restarted): the model and an empty KV cache
    are back, every request's KV and every cached prefix are gone."""


class Executor(abc.ABC):
    """Starts the workers (device setup and model load) in its constructor.

    Args:
        config: the engine's settings.

    Raises (constructor): what the workers raise at start-up (FileNotFoundError for a missing
    model, ValueError for bad settings).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self._init_executor()

    @abc.abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: each sets up its device and loads the model."""

    @abc.abstractmethod
    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """Call a worker method (by name, or a function taking the worker first) on every
        worker; their results in rank order."""

    # ------------------------------------------------------------------ start-up
    def get_model_info(self) -> WorkerInfo:
        """The loaded model and the workers' choices (the first worker's: they all agree)."""
        return self.collective_rpc("get_model_info")[0]

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache spec every worker's model has.

        Raises:
            RuntimeError: the workers disagree.
        """
        specs = self.collective_rpc("get_kv_cache_spec")
        if any(s != specs[0] for s in specs):
            raise RuntimeError(f"workers have different KV cache specs: {specs}")
        return specs[0]

    def determine_available_memory(self) -> int:
        """Bytes of KV cache every worker can hold (the smallest)."""
        return min(self.collective_rpc("determine_available_memory"))

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker and build their model runners."""
        self.collective_rpc("initialize_cache", (num_blocks,))

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the sampled tokens (the first worker's)."""
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def get_kv_connector_output(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """A step without a forward (nothing to run): hand the KV connector's worker half the
        scheduler output's news and take its report (the first worker's)."""
        return self.collective_rpc("get_kv_connector_output", (scheduler_output,))[0]

    def set_kv_wakeup(self, wake: Callable[[], None]) -> None:
        """Have ``wake`` called when the KV connector's worker half finishes or fails a
        transfer (the in-process workers call it themselves)."""
        self.collective_rpc("set_kv_wakeup", (wake,))

    def reserve_cpus(self, cpus: int) -> None:
        """Leave ``cpus`` CPUs of each worker's host to the engine's own background work
        (grammar compiles; 0: none): the workers' compute threads run on the rest."""
        self.collective_rpc("reserve_cpus", (cpus,))

    def export_kv(self, block_ids: list[int], layer: int | None = None):
        """The KV of ``block_ids`` as one contiguous buffer (``ModelRunner.export_kv``): the
        worker side of a KV connector or an offload."""
        return self.collective_rpc("export_kv", (block_ids, layer))[0]

    def import_kv(self, block_ids: list[int], data, layer: int | None = None) -> None:
        """Write a buffer from :meth:`export_kv` into ``block_ids`` (``ModelRunner.import_kv``)."""
        self.collective_rpc("import_kv", (block_ids, data, layer))

    def shutdown(self) -> None:
        """Stop the workers."""
        self.collective_rpc("shutdown")
