"""The synchronous in-process engine (offline ``LLM``, benchmarks, tests): the front end's
processor and output processor around an :class:`~sloserve.engine.core.EngineCore` in the same
process. One ``step()`` = one core step (schedule, run the model, update) plus detokenization.

The same classes run behind the server with the core in its own process
(``sloserve.engine.async_llm``); here no socket sits between them.
"""
from __future__ import annotations

import logging
import time

from sloserve.config import EngineConfig
from sloserve.engine.core import EngineCore
from sloserve.engine.messages import EngineCoreRequest, KVTransferParams
from sloserve.engine.metrics import EngineSummary, SpecDecodingLogger, StatLogger, log_stats
from sloserve.engine.output_processor import OutputProcessor
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.processor import Processor
from sloserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Not thread-safe: use ``add_request`` / ``abort_request`` / ``step`` from one thread.

    Args:
        config: the engine's settings.
        stat_loggers: get every step's :class:`~sloserve.engine.metrics.IterationStats`.
        step_trace: the core writes one JSON line per step to this file.

    Raises (constructor): FileNotFoundError for a missing model, ValueError for bad settings.
    """

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None,
                 step_trace: str | None = None):
        from sloserve.model.loader import load_model_tokenizer

        self.config = config
        self.core = EngineCore(config, step_trace=step_trace)
        self.info = self.core.info
        self.tokenizer = load_model_tokenizer(config.model, config.load_format)
        self.processor = Processor(self.tokenizer, self.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.summary = EngineSummary()
        self.stat_loggers: list[StatLogger] = [self.summary, *(stat_loggers or [])]
        spec = config.speculative
        if spec is not None:
            self.stat_loggers.append(SpecDecodingLogger(logger, spec.num_speculative_tokens))
        #: stats of requests aborted since the last step, reported with the next one

    # the core's parts, for benchmarks and tests that look inside
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def runner(self):
        return self.core.runner

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def dtype_choice(self):
        return self.core.dtype_choice

    @property
    def dtype(self):
        return self.core.dtype

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def model_path(self) -> str:
        return self.info.model_path

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.info.num_kv_blocks

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None,
                     arrival_time: float | None = None, **kw) -> EngineCoreRequest:
        """Tokenize and validate (see Processor.make_request; raises ParamError)."""
        return self.processor.make_request(prompt, params, request_id, arrival_time, **kw)

    def add(self, req: EngineCoreRequest) -> None:
        """Queue a request made by make_request. Raises ValueError (e.g. duplicate id)."""
        self.output_processor.add_request(req)
        try:
            self.core.add_request(req)
        except Exception:
            self.output_processor.abort_request(req.request_id, time.monotonic())
            raise

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None,
                    kv_transfer_params: KVTransferParams | None = None) -> str:
        """make_request + add; returns the request id. ``kv_transfer_params``: one half of a
        disaggregated request (needs a KV connector; its finished output carries what the
        other half takes)."""
        req = self.make_request(prompt, params or SamplingParams(), request_id,
                                kv_transfer_params=kv_transfer_params)
        self.add(req)
        return req.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a queued or running request now and free its KV blocks (None if unknown)."""
        self.core.abort_requests([request_id])
        res = self.output_processor.abort_request(request_id, time.monotonic())
        if res is None:
            return None
        out, fin = res
        log_stats(self.stat_loggers, None, [fin], logger)
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many."""
        return self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that produced a token or finished."""
        outs = self.core.step()
        if outs is None:
            return []
        res = self.output_processor.process_outputs(outs, time.monotonic())
        if res.reqs_to_abort:  # stop strings: free their blocks before the next step
            self.core.abort_requests(res.reqs_to_abort)
        if res.iteration is not None or res.finished:
            log_stats(self.stat_loggers, res.iteration, res.finished, logger)
        return [o for _, o in res.request_outputs]
