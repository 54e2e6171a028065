"""The engine core: the step loop (schedule, execute, update, outputs) over an executor.

It owns the scheduler (which owns the KV cache manager and the structured-output manager) and
an executor (``sloserve.executor``) whose workers own the device, the model, the KV cache
tensors and the model runner; at start-up it asks them for the KV cache spec and the memory the
cache may take and sizes the cache (vLLM's ``EngineCore``).

It takes tokenized requests (:class:`~sloserve.engine.messages.EngineCoreRequest`) and aborts,
and each :meth:`EngineCore.step` returns an :class:`~sloserve.engine.messages.EngineCoreOutputs`
(new token ids per request, finish reasons, the step's stats and a scheduler snapshot). It knows
no HTTP, no tokenizer and no text: detokenization and stop strings live in the front end
(``output_processor``). It runs in its own process behind the server (``core_proc``), in the
caller's process for the offline ``LLM`` and the benchmarks (same class, no socket), and in the
simulator over a cost-model executor on a virtual clock (``sloserve.sim.executor``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

from sloserve.config import EngineConfig
from sloserve.engine.admission import StepRates
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                      EngineInfo, KVTransferParams, SchedulerStats, StepStats)
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.executor import get_executor_class
from sloserve.executor.abstract import Executor, WorkerLostError
from sloserve.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

GiB = 1024 ** 3
#: tests set this to N to make the core's first N model steps fail (an engine bug's path)
INJECT_FAILURES_ENV = "SLOSERVE_INJECT_STEP_FAILURES"


class EngineCore:
    """The step loop over an executor; not thread-safe.

    Everything it knows of the model comes from the executor (the model's shape, the KV cache
    spec, the memory the cache may take), so an executor without a model (the simulator's
    cost-model executor) serves it as well as the workers do.

    Args:
        config: the engine's settings.
        executor: reaches the workers that hold the model and the KV cache (default: an
            in-process :class:`~sloserve.executor.uniproc.UniProcExecutor` built from config).
        step_trace: write one JSON line per step to this file (``--step-trace``).
        scheduler_config: the scheduler's settings as they are (the simulator's); its
            ``max_model_len`` is the core's, not checked against the cache (the scheduler
            refuses a request that cannot fit). Default: ``SchedulerConfig.of`` the config with
            the ``max_model_len`` the cache allows.
        clock: seconds, read at a step's start and end and stamped on its outputs (default
            ``time.monotonic``; the simulator's virtual clock, which its executor advances by
            each step's modelled time).
        raise_step_errors: an exception from a step propagates (the simulator: a modelled
            step that fails is a wrong setting, not a request's bad luck); default: the step's
            requests are failed and the loop goes on.

    Raises (constructor): FileNotFoundError for a missing model, ValueError for bad settings,
    OSError for a step trace that cannot be opened.
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 step_trace: str | None = None, *,
                 scheduler_config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, raise_step_errors: bool = False):
        from sloserve.engine.structured_output import StructuredOutputManager

        config.validate()
        self.config = config
        self.clock = clock
        self.raise_step_errors = raise_step_errors
        if executor is None:
            executor = get_executor_class(config)(config)
        self.model_executor = executor
        winfo = executor.get_model_info()
        self.model_config = winfo.model_config
        #: the KV cache's layout (bytes per token and block), as the workers hold it
        self.kv_cache_spec = executor.get_kv_cache_spec()
        num_blocks, self.max_model_len = config.resolve_kv_cache(
            self.kv_cache_spec.page_size_bytes, executor.determine_available_memory(),
            self.model_config.max_position_embeddings)
        if scheduler_config is not None:
            self.max_model_len = scheduler_config.max_model_len
        executor.initialize_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * self.kv_cache_spec.page_size_bytes
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        #: prefix-cache block events for a router (``--kv-events-config``; the core process
        #: publishes what the pool records)
        self.kv_events_config = None
        if config.kv_events_config:
            from sloserve.engine.kv_events import KVEventsConfig
            self.kv_events_config = KVEventsConfig.of(config.kv_events_config)
            if self.kv_events_config.enabled:
                if not config.enable_prefix_caching:
                    raise ValueError("--kv-events-config needs prefix caching (the events are "
                                     "the prefix cache's); drop --no-enable-prefix-caching")
                self.kv.pool.enable_kv_events()
        #: prefill/decode disaggregation: the KV connector's scheduler half (its worker half
        #: is in the workers, listening on the port they report)
        self.kv_transfer = config.kv_transfer
        self.kv_connector = None
        if self.kv_transfer is not None:
            from sloserve.kv_transfer.scheduler_side import SloserveConnectorScheduler
            host, port = executor.collective_rpc("kv_connector_address")[0]
            self.kv_connector = SloserveConnectorScheduler(
                self.kv_transfer, config.block_size, host, port)
            logger.info("%s", self.kv_transfer.describe(self.kv_connector.engine_id, host, port))
        #: structured outputs: compiles grammars in low-priority worker processes, started at
        #: the first request that asks for one; the scheduler uses it
        self.structured_output_manager = StructuredOutputManager(
            config.model, config.load_format, self.model_config.vocab_size,
            compile_timeout_s=config.structured_outputs_compile_timeout)
        self.scheduler = Scheduler(
            scheduler_config or SchedulerConfig.of(config, self.max_model_len), self.kv,
            structured_output_manager=self.structured_output_manager,
            kv_connector=self.kv_connector)
        self.info = EngineInfo(
            model_name=winfo.model_name, model_path=winfo.model_path,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids), num_kv_blocks=num_blocks,
            block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
            dtype=winfo.dtype, kv_cache_dtype=winfo.kv_cache_dtype,
            dtype_reason=winfo.dtype_reason, pid=os.getpid(),
            scheduling_policy=config.scheduling_policy, max_logprobs=config.max_logprobs,
            model_shape=model_shape(self.model_config, winfo.weight_bytes), **self._kv_info())
        from sloserve.engine.metrics import StepTraceLogger
        self._trace = StepTraceLogger(step_trace) if step_trace else None
        self.num_steps = 0
        self.rates = StepRates()
        #: fault injection for tests of the failure paths: the first N model steps raise
        self._inject_failures = int(os.environ.get(INJECT_FAILURES_ENV, "0") or 0)
        #: speculative decoding: drafts for the decoding requests before each step
        spec = config.speculative
        self.drafter = None
        if spec is not None:
            from sloserve.spec_decode.drafter import Drafter
            # the worker measured what draft rows cost when it built its KV cache
            measured = executor.get_model_info()
            self.drafter = Drafter(spec, winfo.quantized_step_max_tokens, measured.verify_cost,
                                   measured.draft_pass_cost)
            logger.info("%s; %s", spec.describe(), self.drafter.describe())
        #: CPUs the compute threads leave to grammar compiles (Executor.reserve_cpus)
        self._cpus_reserved = 0
        #: the last step's runner output (its timings), for benchmarks
        self.last_runner_output: ModelRunnerOutput | None = None
        logger.info("engine core: %s, %d layers, dtype %s, KV %s, %d KV blocks x %d tokens "
                    "(%.2f GiB), max_model_len %d, policy %s, %s",
                    winfo.model_name, self.model_config.num_hidden_layers, winfo.dtype,
                    winfo.kv_cache_dtype, num_blocks, config.block_size,
                    self.kv_cache_bytes / GiB, self.max_model_len,
                    f"{config.batching} {config.scheduling_policy}"
                    f"{', prefix caching' if config.enable_prefix_caching else ''}"
                    f"{self._pacing_note()}", winfo.description)

    # the in-process worker's parts, for the benchmarks and tests that look inside
    @property
    def _worker(self):
        return self.model_executor.driver_worker

    @property
    def runner(self):
        return self._worker.model_runner

    @property
    def model(self):
        return self._worker.model

    @property
    def dtype_choice(self):
        return self._worker.dtype_choice

    @property
    def dtype(self):
        return self._worker.dtype

    @property
    def kv_cache_dtype(self):
        return self._worker.kv_cache_dtype

    @property
    def weights_line(self) -> str:
        return self._worker.weights_line

    def _kv_info(self) -> dict:
        """EngineInfo's KV connector fields (empty without one)."""
        c = self.kv_connector
        if c is None:
            return {}
        return dict(kv_role=self.kv_transfer.kv_role, kv_engine_id=c.engine_id, kv_host=c.host,
                    kv_port=c.port, kv_mode=self.kv_transfer.mode)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """Have ``wake`` called (from any thread) when a KV transfer finishes or fails, so an
        idle loop that waits only for transfers steps at once (the in-process workers')."""
        if self.kv_connector is not None:
            self.model_executor.set_kv_wakeup(wake)

    def waits_only_for_transfers(self) -> bool:
        """Nothing can run until a KV transfer finishes or times out."""
        return self.scheduler.waits_only_for_transfers()

    def prewarm_for_remote_kv(self, part: int, parts: int) -> bool:
        """While a request's prompt KV is arriving (a decode instance) and nothing else can
        run: read part ``part`` of ``parts`` of the weights its first decode steps will
        stream (``Worker.prewarm_weights``). Returns whether it did."""
        if not self.scheduler.waiting_for_kv:
            return False
        self.model_executor.collective_rpc("prewarm_weights", (part, parts))
        return True

    def _pacing_note(self) -> str:
        """The start-up line's words on prefill pacing (empty when it is off)."""
        s = self.scheduler.config
        if s.policy.value != "chunked" or not self.config.enable_prefill_pacing:
            return ""
        if not s.enable_prefill_pacing:
            return ", no prefill pacing (--ttft-slo-ms estimates TTFT without it)"
        return (f", prefill pacing for prompts over {s.long_prompt_tokens} tokens "
                f"(--no-enable-prefill-pacing turns it off)")

    # ------------------------------------------------------------------ inputs
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request (with ``kv_transfer_params``: one half of a disaggregated request,
        see :class:`~sloserve.engine.messages.KVTransferParams`).

        Raises:
            ValueError: duplicate id, over max_model_len or the KV capacity, computed tokens
                outside [0, prompt + output tokens).
        """
        request = Request(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params, arrival_time=req.arrival_time,
            eos_token_ids=tuple(req.eos_token_ids), parent_request_id=req.parent_request_id,
            priority=req.priority, cache_salt=req.cache_salt)
        kv = req.kv_transfer_params
        if kv is not None and self.kv_connector is not None:
            _check_connector_request(kv, self.kv_transfer)
            request.kv_transfer_params = kv
        elif kv is not None:
            if kv.do_remote_prefill:
                raise ValueError("kv_transfer_params: do_remote_prefill needs a KV connector "
                                 "(--kv-transfer-config)")
            _apply_remote_prefill(request, kv)
        self.scheduler.add_request(request)
        if kv is not None and kv.do_remote_decode:  # checked whole above; runs to its first token
            request.sampling_params = dataclasses.replace(request.sampling_params, max_tokens=1)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finish queued or running requests now and free their KV blocks; unknown ids are
        ignored. Returns an ``abort`` output for each one that was unfinished."""
        outs = []
        for rid in request_ids:
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                outs.append(EngineCoreOutput(request_id=rid, finish_reason="abort",
                                             num_output_tokens=req.num_output_tokens,
                                             num_preemptions=req.num_preemptions,
                                             first_scheduled_time=req.first_scheduled_time,
                                             parent_request_id=req.parent_request_id))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; returns how many (``POST /reset_prefix_cache``)."""
        n = self.kv.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", n)
        return n

    def stats(self) -> SchedulerStats:
        """The snapshot the front end publishes (``/metrics``, overload control)."""
        s, kv = self.scheduler, self.kv
        return SchedulerStats(num_running=len(s.running), num_waiting=len(s.waiting),
                              num_free_blocks=kv.num_free_blocks, num_blocks=self.num_kv_blocks,
                              kv_cache_usage=kv.usage, num_preemptions_total=s.num_preemptions,
                              num_steps_total=self.num_steps,
                              prefix_cache_queries_total=kv.prefix_cache_queries,
                              prefix_cache_hits_total=kv.prefix_cache_hits,
                              num_waiting_tokens=s.num_tokens_to_prefill(),
                              prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
                              decode_step_s=self.rates.decode_step_s,
                              prefill_step_s=self.rates.prefill_step_s,
                              prefill_budget=s.prefill_budget(),
                              num_requests_received_total=s.num_requests_received,
                              num_deferred_total=s.num_deferred,
                              num_grammar_compiles=self.structured_output_manager.num_compiles,
                              num_waiting_for_kv=len(s.waiting_for_kv) + (
                                  len(self.kv_connector.held) if self.kv_connector else 0),
                              kv_transfer_bytes_sent_total=s.kv_transfer_totals[0],
                              kv_transfer_bytes_received_total=s.kv_transfer_totals[1],
                              kv_transfer_failures_total=s.kv_transfer_totals[2])

    # ------------------------------------------------------------------ the step
    def step(self) -> EngineCoreOutputs | None:
        """Schedule, run the model once, update; None when there was nothing to run."""
        t0 = self.clock()
        if self.drafter is not None:
            batch = len(self.scheduler.running)
            if self.drafter.k_for(batch) > 0:  # no token lists built where drafts are off
                # a model's drafts are not masked yet: no drafts for a grammar's requests
                for req, most in self.scheduler.draft_candidates(
                        with_grammar=not self.drafter.config.uses_model):
                    req.spec_token_ids = self.drafter.propose(
                        req.request_id, req.all_token_ids, req.num_prompt_tokens, most, batch)
        out = self.scheduler.schedule(now=t0)
        if self.drafter is not None:
            for rid in out.finished_request_ids:
                self.drafter.finish(rid)
        # requests the scheduler finished without running them (a grammar that failed to compile)
        failed = self.scheduler.take_finished_outputs()
        if out.is_empty:
            news = False
            if self.kv_connector is not None:  # no step: the connector's news still goes
                try:
                    kv_out = self.model_executor.get_kv_connector_output(out)
                except WorkerLostError as e:
                    return EngineCoreOutputs(failed + self._worker_lost(e, out), self.stats(),
                                             timestamp=self.clock())
                news = kv_out.has_news  # freed blocks change the gauges the front end shows
                failed += self.scheduler.update_connector_output(kv_out, t0)
            return EngineCoreOutputs(failed, self.stats(), timestamp=t0) if failed or news \
                else None
        kv_usage = self.kv.usage
        busy = self.structured_output_manager.cpus_busy
        try:
            if busy != self._cpus_reserved:  # the compute threads leave the compiles their CPUs
                self._cpus_reserved = busy
                self.model_executor.reserve_cpus(busy)
            if self._inject_failures > 0:
                self._inject_failures -= 1
                raise RuntimeError(f"injected failure ({INJECT_FAILURES_ENV})")
            runner_out = self.model_executor.execute_model(out)
            now = self.clock()
            outputs = self.scheduler.update_from_output(out, runner_out, now)
            if runner_out.kv_connector_output is not None:  # after: finished requests hold
                outputs += self.scheduler.update_connector_output(
                    runner_out.kv_connector_output, now)
        except WorkerLostError as e:
            return EngineCoreOutputs(failed + self._worker_lost(e, out), self.stats(),
                                     timestamp=self.clock())
        except Exception as e:  # a bug must not kill the loop: fail this step's requests
            if self.raise_step_errors:
                raise
            logger.exception("model step failed")
            return EngineCoreOutputs(
                failed + self._fail(out, f"engine step failed: {type(e).__name__}: {e}"),
                self.stats(), timestamp=self.clock())
        self.last_runner_output = runner_out
        self.num_steps += 1
        if self.drafter is not None:
            for o in outputs:
                if o.num_draft_tokens:
                    self.drafter.observe(o.request_id, o.num_draft_tokens,
                                         o.num_accepted_draft_tokens, o.num_output_tokens)
        self.rates.update(out.num_prefill_tokens, out.num_decode_tokens, now - t0)
        self.scheduler.observe(self.rates)
        pairs, kv_read = out.attention_work()
        step = StepStats(start_time=t0, step_s=now - t0, forward_s=runner_out.forward_s,
                         num_batched_tokens=out.num_batched_tokens,
                         num_prefill_tokens=out.num_prefill_tokens,
                         num_decode_tokens=out.num_decode_tokens,
                         num_generation_tokens=sum(len(o.new_token_ids) for o in outputs),
                         num_preemptions=len(out.preempted_request_ids), kv_cache_usage=kv_usage,
                         num_draft_tokens=sum(o.num_draft_tokens for o in outputs),
                         num_accepted_draft_tokens=sum(o.num_accepted_draft_tokens
                                                       for o in outputs),
                         num_sequences=len(out.scheduled), num_attention_pairs=pairs,
                         num_kv_tokens_read=kv_read)
        stats = self.stats()
        if self._trace is not None:
            self._record_trace(out, step, stats)
        return EngineCoreOutputs(failed + outputs, stats, step, timestamp=now)

    def _record_trace(self, out: SchedulerOutput, step: StepStats, stats: SchedulerStats) -> None:
        reqs = self.scheduler.requests
        admitted = []
        for s in out.scheduled:
            r = reqs.get(s.request_id)
            if r is not None and r.first_scheduled_time == step.start_time:
                admitted.append((r.arrival_time, r.num_prompt_tokens, s.request_id))
        try:
            self._trace.record(out, step, stats, admitted)
        except Exception:  # a full disk must not cost the outputs
            logger.exception("step trace failed; it is dropped")
            self._trace = None

    def _worker_lost(self, e: Exception, out: SchedulerOutput) -> list[EngineCoreOutput]:
        """The worker was replaced (``WorkerLostError``): every request's KV and every cached
        prefix are gone, so every request fails and the prefix cache is forgotten."""
        logger.error("%s", e)
        msg = f"engine step failed: {e}"
        lost = self._fail(out, msg) + self.abort_requests(list(self.scheduler.requests))
        for o in lost:
            o.error = o.error or msg
        self.kv.reset_prefix_cache()
        return lost

    def _fail(self, out: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        outs = []
        for sr in out.scheduled:
            req = self.scheduler.finish_request(sr.request_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                outs.append(EngineCoreOutput(request_id=sr.request_id, finish_reason="abort",
                                             num_output_tokens=req.num_output_tokens,
                                             first_scheduled_time=req.first_scheduled_time,
                                             error=message))
        return outs

    def close(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def _check_connector_request(kv: KVTransferParams, cfg) -> None:
    """Raise ValueError for ``kv_transfer_params`` this instance's connector cannot serve."""
    if kv.do_remote_decode == kv.do_remote_prefill:
        raise ValueError("kv_transfer_params: exactly one of do_remote_decode and "
                         "do_remote_prefill must be true")
    if kv.do_remote_decode and not cfg.is_producer:
        raise ValueError(f"kv_transfer_params: do_remote_decode on a {cfg.kv_role} instance")
    if kv.do_remote_prefill and not cfg.is_consumer:
        raise ValueError(f"kv_transfer_params: do_remote_prefill on a {cfg.kv_role} instance")
    if kv.do_remote_prefill and not kv.transfer_id:
        raise ValueError("kv_transfer_params: do_remote_prefill needs transfer_id (the "
                         "prefill instance's response gives it)")
    if kv.do_remote_prefill and cfg.mode == "pull" and not (kv.remote_host and kv.remote_port):
        raise ValueError("kv_transfer_params: in pull mode do_remote_prefill needs "
                         "remote_host and remote_port (the prefill instance's connector)")


def _apply_remote_prefill(request: Request, kv: KVTransferParams) -> None:
    """Give a decode instance's request the output and computed tokens the prefill instance
    made. Raises ValueError: computed tokens outside [0, prompt + output tokens)."""
    request.output_token_ids = list(kv.output_token_ids)
    if not 0 <= kv.num_computed_tokens < request.num_tokens:
        raise ValueError(f"kv_transfer_params: num_computed_tokens must be in [0, "
                         f"{request.num_tokens}) (the prompt and output tokens), got "
                         f"{kv.num_computed_tokens}")
    request.num_computed_tokens = kv.num_computed_tokens


#: the ModelConfig fields a step's roofline needs (``sloserve.roofline.step.served_roofline``)
_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                 "tie_word_embeddings", "attention_bias")


def model_shape(mc, weight_bytes: int) -> dict:
    """``EngineInfo.model_shape``: the model's layer shapes and the weight bytes a step reads."""
    out = {f: getattr(mc, f) for f in _SHAPE_FIELDS if hasattr(mc, f)}
    out["weight_bytes"] = int(weight_bytes)
    return out
