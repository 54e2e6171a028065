"""The Ray executor: the worker in a Ray actor, on the node Ray (or ``ray_node_ip``) picks
(vLLM's ``RayDistributedExecutor``, ``--distributed-executor-backend ray``). The engine core
stays in its process and calls the actor for every step; the worker's KV connector half lives
in the actor and listens on that node's address.

A worker actor that dies (its process killed, its node lost) is restarted by Ray (``max_restarts``
times); the step that found it gone fails its requests (their KV died with it), the executor
loads the model and allocates the cache in the new actor, and the engine serves on.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from sloserve.executor.abstract import Executor, WorkerLostError
from sloserve.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

#: how often Ray restarts a dead worker actor
MAX_RESTARTS = 4
#: most seconds to wait for a restarted worker actor to take calls again
RESTART_WAIT_S = 300.0


class RayWorkerWrapper:
    """The actor: a :class:`~sloserve.worker.worker.Worker` built on demand (a restarted actor
    starts empty) and any of its methods by name."""

    def __init__(self, config):
        self.config = config
        self.worker = None
        self._news = threading.Event()

    def start(self, num_blocks: int | None = None, kv_port: int | None = None) -> str:
        """Set up the device and load the model (and, given ``num_blocks``, the KV cache, its
        KV connector listening on ``kv_port``: a restarted worker keeps its address); returns
        this node's IP address."""
        import dataclasses

        import ray

        from sloserve.worker.worker import Worker
        if kv_port is not None:
            self.config = dataclasses.replace(self.config, kv_transfer_config=dataclasses.replace(
                self.config.kv_transfer, kv_port=kv_port))
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()
        if num_blocks is not None:
            self.initialize_cache(num_blocks)
        return ray.util.get_node_ip_address()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        if self.worker.model_runner.kv_connector is not None:
            self.worker.model_runner.kv_connector.wake = self._news.set

    def call(self, method: str | Callable, args: tuple, kwargs: dict) -> Any:
        """A worker method by name (``initialize_cache``: this wrapper's), or a function taking
        the worker first."""
        if self.worker is None:
            raise RuntimeError("the worker actor was restarted and is not set up")
        if not isinstance(method, str):
            return method(self.worker, *args, **kwargs)
        target = self if method == "initialize_cache" else self.worker
        return getattr(target, method)(*args, **kwargs)

    def wait_kv_news(self, timeout_s: float) -> bool:
        """Block until the KV connector reports a finished or failed transfer (or the
        timeout); runs beside the steps (a threaded actor)."""
        got = self._news.wait(timeout_s)
        self._news.clear()
        return got


class RayExecutor(Executor):
    """One worker in a Ray actor (``ray_address``: the cluster to join, default a local one;
    ``ray_node_ip``: the node to place it on)."""

    def _init_executor(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg = self.config
        if not ray.is_initialized():
            import signal
            import threading as th
            main = th.current_thread() is th.main_thread()
            handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} \
                if main else {}
            ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            for sig, h in handlers.items():  # Ray's own would end the engine core abruptly
                signal.signal(sig, h)
        opts: dict = dict(num_cpus=0, max_restarts=MAX_RESTARTS, max_concurrency=2)
        if cfg.ray_node_ip:
            nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == cfg.ray_node_ip]
            if not nodes:
                raise ValueError(f"ray_node_ip: no live Ray node at {cfg.ray_node_ip} (nodes: "
                                 f"{', '.join(n['NodeManagerAddress'] for n in ray.nodes())})")
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[0]["NodeID"],
                                                                         soft=False)
        self._actor_cls = ray.remote(RayWorkerWrapper)
        self.actor = self._actor_cls.options(**opts).remote(cfg)
        self.node_ip = self._get(self.actor.start.remote())
        self._num_blocks: int | None = None
        self._kv_port: int | None = None
        self._wake_thread: threading.Thread | None = None
        self._closed = False

    @staticmethod
    def _get(ref):
        import ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # the worker's own exception, as raised there
            raise e.as_instanceof_cause() from None

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        return [self._call(method, args, kwargs or {})]

    def _call(self, method, args, kwargs):
        import ray
        try:
            return self._get(self.actor.call.remote(method, args, kwargs))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                RuntimeError) as e:
            if isinstance(e, RuntimeError) and "restarted" not in str(e):
                raise
            self._restart()
            raise WorkerLostError(f"the worker actor died and was restarted "
                                  f"({type(e).__name__}); its requests are lost") from None

    def _restart(self) -> None:
        """Set a restarted actor up again (model, cache) before the engine goes on, trying
        while Ray still restarts it (up to RESTART_WAIT_S; then the actor is taken as lost
        for good and the error propagates)."""
        import time

        import ray
        logger.warning("the worker actor is gone: waiting for Ray to restart it")
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                self.node_ip = self._get(self.actor.start.remote(self._num_blocks,
                                                                 self._kv_port))
                break
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        logger.warning("the worker actor is back on %s", self.node_ip)

    def initialize_cache(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._get(self.actor.call.remote("initialize_cache", (num_blocks,), {}))
        if self.config.kv_transfer is not None:  # a restarted worker listens there again
            self._kv_port = self._get(self.actor.call.remote("kv_connector_address", (), {}))[1]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", (scheduler_output,), {})

    def set_kv_wakeup(self, wake: Callable[[], None]) -> None:
        """A thread here waits on the actor's news and calls ``wake``."""
        def loop() -> None:
            while not self._closed:
                try:
                    if self._get(self.actor.wait_kv_news.remote(0.5)):
                        wake()
                except Exception:  # the actor is restarting: the step loop handles it
                    if self._closed:
                        return
                    threading.Event().wait(0.5)
        self._wake_thread = threading.Thread(target=loop, name="sloserve-ray-kv-wake",
                                             daemon=True)
        self._wake_thread.start()

    def shutdown(self) -> None:
        import ray
        self._closed = True
        try:
            self._get(self.actor.call.remote("shutdown", (), {}))
        except Exception:  # already gone
            pass
        ray.kill(self.actor, no_restart=True)
