"""The synchronous engine: one `step()` = schedule, run the model once, update, detokenize."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import replace

import torch

from sloserve.config import EngineConfig
from sloserve.engine.detokenizer import IncrementalDetokenizer
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.metrics import (EngineSummary, FinishedRequestStats, IterationStats,
                                     StatLogger)
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from sloserve.sampling_params import ParamError, SamplingParams

logger = logging.getLogger(__name__)

GiB = 1024 ** 3


class LLMEngine:
    """Owns the model runner, the scheduler and the KV cache manager; not thread-safe.

    Use `add_request` / `abort_request` / `step` from one thread (the async engine does).

    Raises (constructor): FileNotFoundError for a missing model, ValueError for bad settings.
    """

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None):
        from sloserve.model.attention import get_attention_backend
        from sloserve.model.layers import RotaryEmbedding
        from sloserve.model.loader import default_model_path, load_model, parse_dtype
        from sloserve.platform import choose_dtype
        from sloserve.model.runner import ModelRunner, kv_bytes_per_block
        from sloserve.model.sampler import Sampler

        self.config = config
        if config.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {config.block_size}")
        if not (math.isfinite(config.kv_cache_memory) and config.kv_cache_memory > 0):
            raise ValueError(f"kv_cache_memory must be a positive number of GiB, got "
                             f"{config.kv_cache_memory}")
        if config.num_threads is not None and config.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {config.num_threads}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        #: the dtypes chosen for this CPU (``--dtype auto``), logged in one line
        self.dtype_choice = choose_dtype(config.dtype, config.kv_cache_dtype)
        logger.info("%s", self.dtype_choice.describe())
        self.dtype = parse_dtype(self.dtype_choice.dtype)
        self.kv_cache_dtype = parse_dtype(self.dtype_choice.kv_cache_dtype)
        self.model, weights = load_model(config.model, self.dtype, config.load_format)
        self.model_config = weights.config
        self.tokenizer = weights.tokenizer
        self.model_name = config.served_model_name or weights.name
        #: local path the weights came from (``/v1/models`` ``root``; bench clients read the
        #: tokenizer from it)
        self.model_path = os.path.abspath(config.model) if config.model else default_model_path()
        self.max_model_len = (self.model_config.max_position_embeddings
                              if config.max_model_len is None else config.max_model_len)
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_model_len > self.model.rope.cos.shape[0]:
            self.model.rope = RotaryEmbedding(self.model_config, self.max_model_len)
        self.model.attn_backend = get_attention_backend(config.attention_backend)

        block_bytes = kv_bytes_per_block(self.model_config, config.block_size, self.kv_cache_dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = int(config.kv_cache_memory * GiB // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block of {block_bytes} bytes "
                             f"(num_kv_blocks={config.num_kv_blocks}, "
                             f"kv_cache_memory={config.kv_cache_memory} GiB)")
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if num_blocks * block_bytes > 0.9 * phys:
            raise ValueError(f"a KV cache of {num_blocks} blocks needs "
                             f"{num_blocks * block_bytes / GiB:.1f} GiB, more than 90% of this "
                             f"machine's {phys / GiB:.1f} GiB of memory")
        kv_tokens = num_blocks * config.block_size
        if config.max_model_len is None:
            # a request that can never fit the cache would preempt itself for ever
            self.max_model_len = min(self.max_model_len, kv_tokens)
        elif self.max_model_len > kv_tokens:
            raise ValueError(
                f"max_model_len={self.max_model_len} tokens does not fit the KV cache of "
                f"{num_blocks} blocks x {config.block_size} = {kv_tokens} tokens; raise "
                f"--kv-cache-memory / --num-kv-blocks or lower --max-model-len")
        self.num_kv_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * block_bytes
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy), self.kv)
        self.sampler = Sampler(config.seed)
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, config.block_size,
                                  self.kv_cache_dtype, self.sampler)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids) | set(
            self.tokenizer.eos_token_ids if self.tokenizer else ())))
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.summary = EngineSummary()
        self.stat_loggers: list[StatLogger] = [self.summary, *(stat_loggers or [])]
        self._counter = 0
        self._aborted_stats: list[FinishedRequestStats] = []
        logger.info("engine: %s, %d layers, dtype %s, %d KV blocks x %d tokens (%.2f GiB), "
                    "max_model_len %d, policy %s", self.model_name,
                    self.model_config.num_hidden_layers, self.dtype, num_blocks, config.block_size,
                    self.kv_cache_bytes / GiB, self.max_model_len, config.scheduling_policy)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Prompt text -> token ids (token id lists pass through). Raises ValueError without a tokenizer."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("this model has no tokenizer; pass token ids", "prompt")
            try:
                return self.tokenizer.encode(prompt)
            except (TypeError, ValueError) as e:  # e.g. lone surrogates
                raise ParamError(f"cannot tokenize the prompt: {e}", "prompt") from e
        return list(prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Tokenize and validate a request without touching engine state (thread-safe).

        max_tokens=None becomes "up to max_model_len".

        Raises:
            ParamError: empty prompt, token id out of the vocabulary, or prompt + max_tokens over
                max_model_len (the message names both numbers and the limit).
        """
        ids = self.encode(prompt)
        n = len(ids)
        if n == 0:
            raise ParamError("prompt must contain at least 1 token, got 0", "prompt")
        vocab = self.model_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ParamError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ParamError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        mt = params.max_tokens
        if mt is None:
            if n >= self.max_model_len:
                raise ParamError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your prompt has {n} tokens, leaving no room for output.", "prompt")
            params = replace(params, max_tokens=self.max_model_len - n)
        elif n + mt > self.max_model_len:
            raise ParamError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + mt} tokens ({n} in the prompt, {mt} in the completion "
                f"(max_tokens)). Please reduce the prompt or max_tokens.", "max_tokens")
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        return Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                       eos_token_ids=self.eos_token_ids)

    def add(self, req: Request) -> None:
        """Queue a request made by make_request. Raises ValueError (e.g. duplicate id)."""
        self.scheduler.add_request(req)
        if self.tokenizer is not None:
            self.detoks[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params.stop,
                req.sampling_params.skip_special_tokens)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """make_request + add; returns the request id."""
        req = self.make_request(prompt, params or SamplingParams(), request_id)
        self.add(req)
        return req.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a queued or running request now and free its KV blocks (None if unknown)."""
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        req.finished_time = time.monotonic()
        out = self._output(req, "", [])
        self._release(request_id)
        self._aborted_stats.append(self._finished_stats(req))  # reported with the next step
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _release(self, request_id: str) -> None:
        self.detoks.pop(request_id, None)
        self.sampler.release(request_id)

    def _output(self, req: Request, delta: str, new_ids: list[int], error: str | None = None):
        d = self.detoks.get(req.request_id)
        return RequestOutput(
            request_id=req.request_id, new_text=delta, new_token_ids=new_ids,
            text=d.text if d else "", token_ids=list(req.output_token_ids),
            finished=req.is_finished, finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            error=error)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that produced a token or finished."""
        t0 = time.monotonic()
        out = self.scheduler.schedule(now=t0)
        if out.is_empty:
            return []
        block_tables = {s.request_id: self.kv.get_block_table(s.request_id) for s in out.scheduled}
        kv_usage = self.kv.usage
        try:
            sampled = self.runner.execute(out, block_tables)
        except Exception as e:  # a bug must not kill the loop: fail this step's requests
            logger.exception("model step failed")
            return self._fail(out, f"engine step failed: {type(e).__name__}: {e}")
        now = time.monotonic()
        prev_times = {s.request_id: s.request.last_token_time for s in out.scheduled if s.samples}
        self.scheduler.update_from_output(out, sampled, now)

        it = IterationStats(num_batched_tokens=out.num_batched_tokens,
                            num_prompt_tokens=out.num_prefill_tokens,
                            num_generation_tokens=len(sampled),
                            num_preemptions=len(out.preempted_request_ids),
                            kv_cache_usage=kv_usage, step_s=now - t0,
                            forward_s=self.runner.last_timings.forward_s, start_time=t0,
                            scheduled=out.scheduled)
        finished_stats, self._aborted_stats = self._aborted_stats, []
        outputs: list[RequestOutput] = []
        for sr in out.scheduled:
            if not sr.samples:
                continue
            req = sr.request
            rid = req.request_id
            tok = sampled[rid]
            prev = prev_times[rid]
            if prev is None:
                it.ttfts.append(now - req.arrival_time)
            else:
                it.itls.append(now - prev)
            try:
                delta = self._detokenize(req, self.detoks.get(rid), tok, now)
            except Exception as e:  # one request's failure must not lose the others' outputs
                logger.exception("detokenization failed for %s", rid)
                if not req.is_finished:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                req.finished_time = now
                outputs.append(self._output(req, "", [tok], error=f"{type(e).__name__}: {e}"))
                self._release(rid)
                continue
            outputs.append(self._output(req, delta, [tok]))
            if req.is_finished:
                finished_stats.append(self._finished_stats(req))
                self._release(rid)
        it.num_running = len(self.scheduler.running)
        it.num_waiting = len(self.scheduler.waiting)
        for lg in list(self.stat_loggers):
            try:
                lg.record(it, finished_stats)
            except Exception:  # a broken logger (disk full, ...) must not cost the outputs
                logger.exception("stat logger %s failed; it is dropped", type(lg).__name__)
                self.stat_loggers.remove(lg)
        return outputs

    def _detokenize(self, req: Request, detok: IncrementalDetokenizer | None, tok: int,
                    now: float) -> str:
        """New visible text for `tok`; finishes the request when a stop string matches."""
        if detok is None:
            return ""
        hidden = req.status is RequestStatus.FINISHED_STOPPED  # EOS / stop token id: not shown
        delta = detok.add_token(None if hidden else tok, finished=req.is_finished)
        if detok.stopped:  # a stop string matched (maybe on the last allowed token)
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.finished_time = now
            req.status = RequestStatus.FINISHED_STOPPED
        return delta

    def _fail(self, out: SchedulerOutput, message: str) -> list[RequestOutput]:
        outputs = []
        for sr in out.scheduled:
            req = self.scheduler.finish_request(sr.request_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                req.finished_time = time.monotonic()
                outputs.append(self._output(req, "", [], error=message))
                self._release(req.request_id)
        return outputs

    @staticmethod
    def _finished_stats(req: Request) -> FinishedRequestStats:
        e2e = req.finished_time - req.arrival_time
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        n = req.num_output_tokens
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
        sched = req.first_scheduled_time if req.first_scheduled_time is not None else req.finished_time
        return FinishedRequestStats(
            finish_reason=req.status.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=n, e2e_latency=e2e, queue_time=sched - req.arrival_time,
            ttft=ttft, tpot=tpot,
            prefill_time=None if req.first_token_time is None else req.first_token_time - sched,
            decode_time=None if req.first_token_time is None else req.finished_time - req.first_token_time)
