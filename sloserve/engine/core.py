"""The engine core: scheduler, KV cache manager, model runner and sampler, and nothing else.

It takes tokenized requests (:class:`~sloserve.engine.messages.EngineCoreRequest`) and aborts,
and each :meth:`EngineCore.step` returns an :class:`~sloserve.engine.messages.EngineCoreOutputs`
(new token ids per request, finish reasons, the step's stats and a scheduler snapshot). It knows
no HTTP, no tokenizer and no text: detokenization and stop strings live in the front end
(``output_processor``). It runs in its own process behind the server (``core_proc``) or in the
caller's process for the offline ``LLM`` and the benchmarks (same class, no socket).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from sloserve.config import EngineConfig
from sloserve.engine.admission import StepRates
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                      EngineInfo, SchedulerStats, StepStats)
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

GiB = 1024 ** 3
#: tests set this to N to make the core's first N model steps fail (an engine bug's path)
INJECT_FAILURES_ENV = "SLOSERVE_INJECT_STEP_FAILURES"


class EngineCore:
    """Owns the model runner, the scheduler and the KV cache manager; not thread-safe.

    Args:
        config: the engine's settings.
        step_trace: write one JSON line per step to this file (``--step-trace``).

    Raises (constructor): FileNotFoundError for a missing model, ValueError for bad settings,
    OSError for a step trace that cannot be opened.
    """

    def __init__(self, config: EngineConfig, step_trace: str | None = None):
        from sloserve.embedded import default_model_path
        from sloserve.model.attention import get_attention_backend
        from sloserve.model.loader import parse_dtype, parse_kv_cache_dtype
        from sloserve.model.model_loader import get_model
        from sloserve.model.runner import ModelRunner, kv_bytes_per_block
        from sloserve.model.sampler import Sampler
        from sloserve.platform import choose_dtype
        from sloserve.roofline.kv import blocks_that_fit

        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        #: the dtypes chosen for this CPU (``--dtype auto``), logged in one line
        self.dtype_choice = choose_dtype(config.dtype, config.kv_cache_dtype)
        logger.info("%s", self.dtype_choice.describe())
        self.dtype = parse_dtype(self.dtype_choice.dtype)
        self.kv_cache_dtype = parse_kv_cache_dtype(self.dtype_choice.kv_cache_dtype)
        attn = get_attention_backend(config.attention_backend, self.kv_cache_dtype)
        attn.compute_dtype = self.dtype
        self.model, weights_name, self.weights_line = get_model(config, self.dtype)
        self.model_config = self.model.config
        model_name = config.served_model_name or weights_name
        model_path = os.path.abspath(config.model) if config.model else default_model_path()

        block_bytes = kv_bytes_per_block(self.model_config, config.block_size, self.kv_cache_dtype)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = blocks_that_fit(config.kv_cache_memory * GiB,
                                         block_bytes / config.block_size, config.block_size)
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block of {block_bytes} bytes "
                             f"(num_kv_blocks={config.num_kv_blocks}, "
                             f"kv_cache_memory={config.kv_cache_memory} GiB)")
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if num_blocks * block_bytes > 0.9 * phys:
            raise ValueError(f"a KV cache of {num_blocks} blocks needs "
                             f"{num_blocks * block_bytes / GiB:.1f} GiB, more than 90% of this "
                             f"machine's {phys / GiB:.1f} GiB of memory")
        self.max_model_len = config.resolve_max_model_len(
            self.model_config.max_position_embeddings, num_blocks * config.block_size)
        self.num_kv_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * block_bytes
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig.of(config, self.max_model_len), self.kv)
        logger.info("%s", self.weights_line)
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, config.block_size,
                                  self.kv_cache_dtype, Sampler(config.seed), attn,
                                  logprobs_mode=config.logprobs_mode)
        self.info = EngineInfo(
            model_name=model_name, model_path=model_path, max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids), num_kv_blocks=num_blocks,
            block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
            dtype=self.dtype_choice.dtype, kv_cache_dtype=self.dtype_choice.kv_cache_dtype,
            dtype_reason=f"{self.dtype_choice.describe()}; {self.weights_line}", pid=os.getpid(),
            scheduling_policy=config.scheduling_policy, max_logprobs=config.max_logprobs)
        from sloserve.engine.metrics import StepTraceLogger
        self._trace = StepTraceLogger(step_trace) if step_trace else None
        self.num_steps = 0
        self.rates = StepRates()
        #: fault injection for tests of the failure paths: the first N model steps raise
        self._inject_failures = int(os.environ.get(INJECT_FAILURES_ENV, "0") or 0)
        #: the last step's runner output (its timings), for benchmarks
        self.last_runner_output: ModelRunnerOutput | None = None
        #: structured outputs: built at the first request that asks for them (loads xgrammar
        #: and the tokenizer in its worker thread); requests whose grammar is compiling
        self._structured = None
        self._grammar_pending: set[str] = set()
        logger.info("engine core: %s, %d layers, dtype %s, KV %s, %d KV blocks x %d tokens "
                    "(%.2f GiB), max_model_len %d, policy %s, attention %s, %d torch threads",
                    model_name, self.model_config.num_hidden_layers, self.dtype,
                    self.kv_cache_dtype, num_blocks, config.block_size,
                    self.kv_cache_bytes / GiB, self.max_model_len,
                    f"{config.batching} {config.scheduling_policy}"
                    f"{', prefix caching' if config.enable_prefix_caching else ''}"
                    f"{self._pacing_note()}",
                    attn.describe(self.kv_cache_dtype), torch.get_num_threads())

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
        """Queue a request. Raises ValueError (duplicate id, over the KV capacity, ...)."""
        r = Request(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params, arrival_time=req.arrival_time,
            eos_token_ids=tuple(req.eos_token_ids), parent_request_id=req.parent_request_id,
            priority=req.priority, cache_salt=req.cache_salt)
        spec = req.sampling_params.structured_outputs
        if spec is not None:
            r.grammar = self._structured_manager().grammar_for(spec)
        self.scheduler.add_request(r)
        if spec is not None:
            self._grammar_pending.add(r.request_id)

    def _structured_manager(self):
        if self._structured is None:
            from sloserve.engine.structured_output import StructuredOutputManager
            from sloserve.model.loader import load_model_tokenizer
            cfg = self.config
            self._structured = StructuredOutputManager(
                lambda: load_model_tokenizer(cfg.model, cfg.load_format),
                self.model_config.vocab_size)
        return self._structured

    def _fail_broken_grammars(self) -> list[EngineCoreOutput]:
        """Finish requests whose grammar failed to compile (an engine fault: the front end
        checked the spec)."""
        outs = []
        for rid in list(self._grammar_pending):
            r = self.scheduler.requests.get(rid)
            if r is None or r.grammar.ready:
                self._grammar_pending.discard(rid)
            if r is not None and r.grammar.ready and r.grammar.error:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                outs.append(EngineCoreOutput(request_id=rid, finish_reason="abort",
                                             error=f"grammar compilation failed: "
                                                   f"{r.grammar.error}"))
        return outs

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
                              num_deferred_total=s.num_deferred)

    # ------------------------------------------------------------------ the step
    def step(self) -> EngineCoreOutputs | None:
        """Schedule, run the model once, update; None when there was nothing to run."""
        t0 = time.monotonic()
        failed = self._fail_broken_grammars() if self._grammar_pending else []
        out = self.scheduler.schedule(now=t0)
        if out.is_empty:
            return EngineCoreOutputs(failed, self.stats(), timestamp=t0) if failed else None
        kv_usage = self.kv.usage
        grammars, broken = self._fill_bitmasks(out) if self._structured is not None else ({}, {})
        try:
            if self._inject_failures > 0:
                self._inject_failures -= 1
                raise RuntimeError(f"injected failure ({INJECT_FAILURES_ENV})")
            runner_out = self.runner.execute(out)
            now = time.monotonic()
            outputs = self.scheduler.update_from_output(out, runner_out, now)
            if grammars or broken:
                for o in outputs:
                    self._advance_grammar(o, grammars.get(o.request_id),
                                          broken.get(o.request_id))
        except Exception as e:  # a bug must not kill the loop: fail this step's requests
            logger.exception("model step failed")
            return EngineCoreOutputs(self._fail(out, f"engine step failed: {type(e).__name__}: {e}"),
                                     self.stats(), timestamp=time.monotonic())
        self.last_runner_output = runner_out
        self.num_steps += 1
        self.rates.update(out.num_prefill_tokens, out.num_decode_tokens, now - t0)
        self.scheduler.observe(self.rates)
        step = StepStats(start_time=t0, step_s=now - t0, forward_s=runner_out.forward_s,
                         num_batched_tokens=out.num_batched_tokens,
                         num_prefill_tokens=out.num_prefill_tokens,
                         num_decode_tokens=out.num_decode_tokens,
                         num_generation_tokens=sum(len(o.new_token_ids) for o in outputs),
                         num_preemptions=len(out.preempted_request_ids), kv_cache_usage=kv_usage)
        stats = self.stats()
        if self._trace is not None:
            self._record_trace(out, step, stats)
        return EngineCoreOutputs(failed + outputs, stats, step, timestamp=now)

    def _fill_bitmasks(self, out: SchedulerOutput) -> tuple[dict, dict]:
        """Set the token bitmask of every sampling request with a grammar; returns their
        grammars by request id (to advance with the tokens the step samples) and, by request
        id, why a request's grammar cannot go on and whether that is the request's own fault:
        (message, True) when its mask allows no token, not even EOS (an unsatisfiable spec: a
        400), (message, False) when the matcher failed. Those run this step without a mask (a row
        with every token masked cannot be sampled from) and fail after it: a failure here must
        neither fail the step's other requests nor stop the core."""
        grammars, broken = {}, {}
        reqs = self.scheduler.requests
        for sr in out.scheduled:
            r = reqs.get(sr.request_id)
            if sr.samples and r is not None and r.grammar is not None:
                try:
                    mask = r.grammar.fill_bitmask()
                except Exception as e:
                    broken[sr.request_id] = (f"structured output failed: "
                                             f"{type(e).__name__}: {e}", False)
                    continue
                if not mask.strip(b"\0"):
                    broken[sr.request_id] = ("structured output: no token can continue the "
                                             "output under its grammar (the spec cannot be "
                                             "satisfied)", True)
                    continue
                sr.token_bitmask = [mask]
                grammars[sr.request_id] = r.grammar
        return grammars, broken

    def _advance_grammar(self, o: EngineCoreOutput, g,
                         broken: tuple[str, bool] | None) -> None:
        """Advance a request's matcher over the tokens it got this step. A grammar that is
        complete (it accepted a stop token) finishes the request (``stop``) even where the
        engine would go on (``ignore_eos``, or a stop token the engine does not stop on): no
        token may follow. A token the grammar refuses (or a broken grammar) fails the request."""
        why, bad_request = broken or (None, False)
        for j, tok in enumerate(o.new_token_ids if g is not None and why is None else ()):
            if not g.accept(tok):
                why = f"structured output: token {tok} is outside the request's grammar"
                break
            if g.is_terminated:
                del o.new_token_ids[j + 1:]
                if o.new_logprobs is not None:
                    o.new_logprobs = o.new_logprobs.slice(0, j + 1)
                if o.finish_reason is None:
                    req = self.scheduler.finish_request(o.request_id,
                                                        RequestStatus.FINISHED_STOPPED)
                    o.finish_reason = "stop"
                    o.stop_reason = tok
                    if req is not None:
                        o.first_scheduled_time = req.first_scheduled_time
                break
        if why is not None:
            logger.warning("%s: %s", o.request_id, why)
            req = self.scheduler.finish_request(o.request_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                o.first_scheduled_time = req.first_scheduled_time
            o.finish_reason = "abort"
            o.error, o.bad_request = why, bad_request

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
        if self._structured is not None:
            self._structured.shutdown()
        if self._trace is not None:
            self._trace.close()
            self._trace = None
