"""The in-process executor: one worker in the engine core's own process (vLLM's
``UniProcExecutor``), the default."""
from __future__ import annotations

from typing import Any, Callable

from sloserve.executor.abstract import Executor
from sloserve.step_io import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """Runs :class:`~sloserve.worker.worker.Worker` in this process; calls are plain calls."""

    def _init_executor(self) -> None:
        from sloserve.worker.worker import Worker
        #: the one worker (tests and benchmarks reach its runner through it)
        self.driver_worker = Worker(self.config)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        fn = getattr(self.driver_worker, method) if isinstance(method, str) else \
            (lambda *a, **k: method(self.driver_worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)
