"""The worker: the device half under the engine core (vLLM's ``Worker``).

It owns what depends on the hardware and the weights: the torch threads and the dtype chosen
for this CPU (``sloserve.platform.choose_dtype``), the attention backend, the loaded model and
the kernels each of its ops runs on (with their warm-up), the KV cache spec, the KV cache tensors (allocated once,
after a check against the machine's memory) and the model runner that runs each step. The
engine core reaches it only through an executor (``sloserve.executor``): the in-process one
calls it directly; a multi-process or Ray executor would run one per process and call the same
methods (plain data in and out, apart from KV export / import buffers).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch

from sloserve.config import EngineConfig
from sloserve.kv_cache_spec import KVCacheSpec
from sloserve.step_io import VERIFY_COST_TOKENS, ModelRunnerOutput, SchedulerOutput, WorkerInfo

logger = logging.getLogger(__name__)

GiB = 1024 ** 3
#: a KV cache may take at most this share of the machine's memory
MAX_KV_SHARE_OF_MEMORY = 0.9


class Worker:
    """One model replica; call :meth:`init_device`, :meth:`load_model`, then
    :meth:`initialize_cache` before :meth:`execute_model`. Not thread-safe.

    Args:
        config: the engine's settings (model, dtype, threads, attention backend, ...).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.dtype_choice = None
        self.dtype: torch.dtype | None = None
        self.kv_cache_dtype: torch.dtype | None = None
        self.attn_backend = None
        self.model = None
        self.model_config = None
        #: speculative decoding's draft model (``draft_model``), or None
        self.draft_model = None
        #: speculative decoding: ``ModelRunner.measure_verify_cost`` at start-up (or empty),
        #: and a model drafter's pass over a decode step (``ModelDrafter.measure_pass_cost``)
        self.verify_cost: list[float] = []
        self.draft_pass_cost = 0.0
        self.model_name = ""
        #: the one log line on which weights and kernels serve which steps
        self.weights_line = ""
        self.model_runner = None
        #: one thread fewer while other processes hold the cores (sloserve.worker.threads)
        self.thread_governor = None

    # ------------------------------------------------------------------ start-up
    def init_device(self) -> None:
        """Set the torch threads (``sloserve.cpus.cpu_budget``: ``--num-threads``,
        ``OMP_NUM_THREADS``, or the CPUs this process may use, then adjusted by
        ``sloserve.worker.threads``), choose the dtypes and the
        attention backend for this CPU (logged in one line). Raises ValueError for an unknown
        dtype or backend."""
        from sloserve.cpus import cpu_budget
        from sloserve.model.attention import get_attention_backend
        from sloserve.model.loader import parse_dtype, parse_kv_cache_dtype
        from sloserve.platform import choose_dtype

        cfg = self.config
        budget = cpu_budget(cfg.num_threads)
        if budget.source == "detected" and torch.get_num_threads() < budget.threads:
            # this process already runs fewer (torch.set_num_threads before an in-process
            # engine, or torch's default of one thread per physical core): kept
            budget = dataclasses.replace(budget, threads=torch.get_num_threads(), source="torch")
        torch.set_num_threads(budget.threads)
        if budget.source in ("detected", "torch"):  # never against --num-threads / OMP_NUM_THREADS
            from sloserve.worker.threads import ThreadGovernor
            self.thread_governor = ThreadGovernor(budget.threads, torch.set_num_threads)
        self.dtype_choice = choose_dtype(cfg.dtype, cfg.kv_cache_dtype, budget)
        logger.info("%s", self.dtype_choice.describe())
        self.dtype = parse_dtype(self.dtype_choice.dtype)
        self.kv_cache_dtype = parse_kv_cache_dtype(self.dtype_choice.kv_cache_dtype)
        self.attn_backend = get_attention_backend(cfg.attention_backend, self.kv_cache_dtype)
        self.attn_backend.compute_dtype = self.dtype
        if cfg.batch_invariant:
            if not self.attn_backend.supports_batch_invariant:
                raise ValueError(f"--batch-invariant needs an attention backend that computes "
                                 f"each query row alone (cpu-paged, on the CPU kernels); "
                                 f"{self.attn_backend.name} does not")
            self.attn_backend.batch_invariant = True

    def load_model(self) -> None:
        """Load the weights and build the model on the ops that serve this CPU (warmed up).

        Raises:
            FileNotFoundError: a missing model; ValueError: weights that do not fit the settings.
        """
        from sloserve.model.model_loader import get_model

        self.model, weights_name, self.weights_line = get_model(self.config, self.dtype)
        self.model_config = self.model.config
        self.model_name = self.config.served_model_name or weights_name
        logger.info("%s", self.weights_line)
        spec = self.config.speculative
        if spec is not None and spec.method == "layer_skip" \
                and spec.num_draft_layers >= self.model_config.num_hidden_layers:
            raise ValueError(f"speculative_config: num_draft_layers must be below the model's "
                             f"{self.model_config.num_hidden_layers} layers, got "
                             f"{spec.num_draft_layers}")
        if spec is not None and spec.method == "draft_model":
            self.draft_model, name, line = get_model(
                # drafts need not be batch-invariant: verification keeps the output exact
                dataclasses.replace(self.config, model=spec.model, served_model_name=None,
                                    batch_invariant=False), self.dtype)
            v, dv = self.model_config.vocab_size, self.draft_model.config.vocab_size
            if dv != v:
                raise ValueError(f"speculative_config: the draft model {spec.model} has a "
                                 f"vocabulary of {dv} tokens, the served model {v}: they must "
                                 f"be the same")
            logger.info("draft model %s: %s", name, line)

    def get_model_info(self) -> WorkerInfo:
        """What the engine core needs to know of the loaded model and the choices made here."""
        from sloserve.embedded import default_model_path

        cfg = self.config
        return WorkerInfo(
            model_name=self.model_name,
            model_path=os.path.abspath(cfg.model) if cfg.model else default_model_path(),
            model_config=self.model_config, dtype=self.dtype_choice.dtype,
            kv_cache_dtype=self.dtype_choice.kv_cache_dtype,
            dtype_reason=f"{self.dtype_choice.describe()}; {self.weights_line}",
            description=(f"attention {self.attn_backend.describe(self.kv_cache_dtype)}, "
                         f"{torch.get_num_threads()} torch threads"),
            quantized_step_max_tokens=getattr(getattr(self.model, "policy", None),
                                              "quant_max_tokens", 0),
            verify_cost=list(self.verify_cost), draft_pass_cost=self.draft_pass_cost,
            weight_bytes=(getattr(self.model, "quantized_weight_bytes", 0)
                          or getattr(self.model, "dense_weight_bytes", 0)))

    # ------------------------------------------------------------------ the KV cache
    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache layout of the loaded model in the chosen KV dtype."""
        from sloserve.model.runner import kv_cache_spec
        spec = kv_cache_spec(self.model_config, self.config.block_size, self.kv_cache_dtype)
        if self.draft_model is not None:  # its cache shares the block tables: as many layers'
            draft = kv_cache_spec(self.draft_model.config, 1, self.kv_cache_dtype)  # worth
            per_layer = spec.bytes_per_token / spec.num_layers
            spec = dataclasses.replace(spec, num_layers=spec.num_layers + math.ceil(
                draft.bytes_per_token / per_layer))
        return spec

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take: ``--kv-cache-memory`` (a CPU process has no device
        memory to profile; vLLM measures what its GPU has left after a dummy step)."""
        return int(self.config.kv_cache_memory * GiB)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks and build the model runner over them.

        Raises:
            ValueError: the cache would take more than 90 % of this machine's memory.
        """
        from sloserve.model.runner import ModelRunner
        from sloserve.model.sampler import Sampler

        need = num_blocks * self.get_kv_cache_spec().page_size_bytes
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > MAX_KV_SHARE_OF_MEMORY * phys:
            raise ValueError(f"a KV cache of {num_blocks} blocks needs {need / GiB:.1f} GiB, "
                             f"more than 90% of this machine's {phys / GiB:.1f} GiB of memory")
        cfg = self.config
        self.model_runner = ModelRunner(self.model, self.model_config, num_blocks, cfg.block_size,
                                        self.kv_cache_dtype,
                                        Sampler(cfg.seed, batch_invariant=cfg.batch_invariant),
                                        self.attn_backend, logprobs_mode=cfg.logprobs_mode)
        kvt = cfg.kv_transfer
        if kvt is not None:  # the KV connector's worker half, over these cache tensors
            from sloserve.kv_transfer.worker_side import SloserveConnectorWorker
            self.model_runner.kv_connector = SloserveConnectorWorker(
                kvt, self.model_runner.kv_caches, self.attn_backend, cfg.block_size,
                self.model_config.vocab_size)
        spec = cfg.speculative
        if spec is not None:  # what draft rows cost here: the drafter's k per batch size
            self.verify_cost = self.model_runner.measure_verify_cost()
            logger.info("a verify step of 1 + k rows costs %s a decode step (k = %s)",
                        ", ".join(f"{c:.2f}x" for c in self.verify_cost[1:]),
                        ", ".join(str(t - 1) for t in VERIFY_COST_TOKENS[1:]))
        if spec is not None and spec.uses_model:
            from sloserve.model.draft import ModelDrafter
            runner = self.model_runner
            if spec.method == "layer_skip":
                model, caches, layers = self.model, runner.kv_caches, spec.num_draft_layers
            else:
                model, layers = self.draft_model, None
                caches = ModelRunner.allocate_kv(self.draft_model.config, num_blocks,
                                                 cfg.block_size, self.kv_cache_dtype,
                                                 self.attn_backend)
            runner.drafter = ModelDrafter(model, caches, layers, self.attn_backend,
                                          cfg.block_size, runner.sampler,
                                          spec.draft_sample_method == "probabilistic",
                                          catch_up=spec.method == "draft_model")
            self.draft_pass_cost = runner.drafter.measure_pass_cost(runner)
            logger.info("a draft pass costs %.2fx a decode step", self.draft_pass_cost)

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (forward and sampling) on the model runner."""
        started = time.monotonic()
        out = self.model_runner.execute(scheduler_output)
        if self.thread_governor is not None:
            self.thread_governor.after_step(started)
        return out

    def prewarm_weights(self, part: int, parts: int) -> None:
        """Bring part ``part`` of ``parts`` of a decode step's weights into the CPU's caches
        (``ModelRunner.prewarm_weights``)."""
        self.model_runner.prewarm_weights(part, parts)

    def kv_connector_address(self) -> tuple[str, int]:
        """Where the KV connector's worker half listens, as another host reaches it: its
        ``kv_ip``, or this host's address where that is a wildcard (0.0.0.0)."""
        import socket
        host = self.config.kv_transfer.kv_ip
        if host in ("0.0.0.0", "", "::"):
            try:
                import ray
                host = ray.util.get_node_ip_address() if ray.is_initialized() else None
            except ImportError:
                host = None
            host = host or socket.gethostbyname(socket.gethostname())
        return host, self.model_runner.kv_connector.port

    def set_kv_wakeup(self, wake) -> None:
        """Call ``wake`` when a KV transfer finishes or fails (in-process executors only)."""
        self.model_runner.kv_connector.wake = wake

    def get_kv_connector_output(self, scheduler_output: SchedulerOutput):
        """A step without a forward: the KV connector takes its news and reports."""
        conn = self.model_runner.kv_connector
        conn.bind_connector_metadata(scheduler_output)
        return conn.build_connector_output()

    def reserve_cpus(self, cpus: int) -> None:
        """One compute thread fewer per CPU the engine's grammar compiles hold
        (``ThreadGovernor.reserve``); none under ``--num-threads`` / ``OMP_NUM_THREADS``."""
        if self.thread_governor is not None:
            self.thread_governor.reserve(cpus)

    def export_kv(self, block_ids: list[int], layer: int | None = None) -> torch.Tensor:
        """See ``ModelRunner.export_kv``."""
        return self.model_runner.export_kv(block_ids, layer)

    def import_kv(self, block_ids: list[int], data: torch.Tensor, layer: int | None = None) -> None:
        """See ``ModelRunner.import_kv``."""
        self.model_runner.import_kv(block_ids, data, layer)

    def shutdown(self) -> None:
        """Release what outlives the worker object: the KV connector's socket and transfers
        (the model and the KV cache are freed with it; tests and benchmarks may still read
        them after ``close``)."""
        conn = getattr(self.model_runner, "kv_connector", None)
        if conn is not None:
            conn.close()
