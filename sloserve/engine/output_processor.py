"""Front-end output processing: engine-core outputs -> text deltas, stop strings, usage, stats.

Per request it keeps an incremental detokenizer. New token ids from the core become text; a stop
string that matches finishes the request here (``finish_reason`` ``stop``) and is handed back as
an abort for the core (``reqs_to_abort``), and ``usage`` counts only the tokens up to the one
that completed the stop string (tokens the core made after it are dropped). Stop strings are
the one finish outside the core's scheduler (which finishes requests on stop tokens, EOS,
lengths and grammars): matching them needs the text, so they stay here, as in vLLM's
``OutputProcessor``. TTFT and ITL are measured when outputs reach the front end, so they include
the trip from the core. A finished output passes on the core's ``kv_transfer_params`` (a prefill
instance's, for the decode request) and each decode request's KV-transfer time goes to the
next step's stats.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from sloserve.engine.detokenizer import IncrementalDetokenizer
from sloserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from sloserve.engine.metrics import FinishedRequestStats, IterationStats, SpecDecodingStats
from sloserve.engine.outputs import RequestOutput
from sloserve.latency import tpot
from sloserve.logprobs import Logprobs

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the front end tracks of one unfinished request."""

    request: EngineCoreRequest
    detok: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: Logprobs | None = None   # accumulated until its first output
    sent_first: bool = False                  # its first output (with the prompt's) went out
    #: where its outputs go (the async front end's queue); None in-process
    sink: Any = None


@dataclass
class ProcessedOutputs:
    """Result of :meth:`OutputProcessor.process_outputs`.

    Attributes:
        request_outputs: (sink, output) per request with news, sink None in-process.
        reqs_to_abort: requests finished by a stop string: abort them in the core.
        iteration: the step's stats (None for a message without a step).
        finished: stats of the requests that finished with it.
    """

    request_outputs: list[tuple[Any, RequestOutput]]
    reqs_to_abort: list[str]
    iteration: IterationStats | None
    finished: list[FinishedRequestStats]


class OutputProcessor:
    """Thread-safe (the async front end adds requests from the event loop and processes outputs
    in its receiver thread).

    Args:
        tokenizer: decodes output tokens (None: no text, token ids only).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        #: KV-transfer times that came with messages without a step, for the next step's stats
        #: (only the thread that processes outputs touches it)
        self._kv_transfer_s: list[float] = []
        self._pending_ttfts: list[float] = []
        self._pending_itls: list[float] = []

    def add_request(self, req: EngineCoreRequest, sink: Any = None) -> None:
        """Track a request about to be sent to the core. Raises ValueError for a duplicate id."""
        sp = req.sampling_params
        detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, sp.stop,
                                        sp.skip_special_tokens)
                 if self.tokenizer is not None else None)
        with self._lock:
            if req.request_id in self._states:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            self._states[req.request_id] = RequestState(req, detok, sink=sink)

    def has_unfinished(self) -> bool:
        return bool(self._states)

    def get_state(self, request_id: str) -> RequestState | None:
        """The tracked state of an unfinished request (None once it finished or was aborted)."""
        with self._lock:
            return self._states.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def sinks(self) -> list[Any]:
        with self._lock:
            return [s.sink for s in self._states.values()]

    def abort_request(self, request_id: str, now: float) -> tuple[RequestOutput, FinishedRequestStats] | None:
        """Forget a request the front end gave up on (client gone); its ``abort`` output and
        stats, None if it is unknown (already finished)."""
        with self._lock:
            st = self._states.pop(request_id, None)
        if st is None:
            return None
        out = self._output(st, "", [], True, "abort", None)
        return out, self._finished_stats(st, "abort", now, None)

    def fail_all(self, message: str) -> list[tuple[Any, RequestOutput]]:
        """The core died: finish every request with ``message`` as its error."""
        with self._lock:
            states, self._states = list(self._states.values()), {}
        return [(st.sink, self._output(st, "", [], True, "abort", message)) for st in states]

    # ------------------------------------------------------------------ outputs
    def process_outputs(self, outs: EngineCoreOutputs, now: float) -> ProcessedOutputs:
        """Turn one core message into request outputs (``now``: when it arrived, monotonic s)."""
        results: list[tuple[Any, RequestOutput]] = []
        to_abort: list[str] = []
        finished: list[FinishedRequestStats] = []
        # latencies of a message without a step (a decode instance's first token, arrived
        # with its KV) wait for the next step's stats
        ttfts, itls = self._pending_ttfts, self._pending_itls
        self._kv_transfer_s += [o.kv_transfer_s for o in outs.outputs if o.kv_transfer_s > 0]
        for o in outs.outputs:
            with self._lock:
                st = self._states.get(o.request_id)
            if st is None:
                continue  # aborted by the front end, or stopped by a stop string before
            if o.new_prompt_logprobs is not None:
                if st.prompt_logprobs is None:
                    st.prompt_logprobs = Logprobs.empty()
                st.prompt_logprobs.extend(o.new_prompt_logprobs)
            if not o.new_token_ids and o.finish_reason is None and not o.error:
                continue  # a prefill chunk's prompt logprobs: kept for the first output
            if o.new_token_ids:
                if st.first_token_time is None:
                    st.first_token_time = now
                    ttfts.append(now - st.request.arrival_time)
                else:
                    itls.append(now - st.last_token_time)
                st.last_token_time = now
            if o.num_cached_tokens:
                st.num_cached_tokens = o.num_cached_tokens
            try:
                new_ids, delta, reason, error = self._advance(st, o)
            except Exception as e:  # one request's failure must not lose the others' outputs
                logger.exception("output processing failed for %s", o.request_id)
                new_ids, delta, reason, error = [], "", "abort", f"{type(e).__name__}: {e}"
            if reason is not None:
                with self._lock:
                    self._states.pop(o.request_id, None)
                if o.finish_reason is None:  # a stop string (or a failure) here: stop the core
                    to_abort.append(o.request_id)
                finished.append(self._finished_stats(st, reason, now, o.first_scheduled_time))
            out = self._output(st, delta, new_ids, reason is not None, reason, error,
                               o.bad_request and error is not None)
            if reason is not None:
                out.kv_transfer_params = o.kv_transfer_params
            if o.new_logprobs is not None:
                out.new_logprobs = o.new_logprobs.slice(0, len(new_ids))
            results.append((st.sink, out))
        it = None
        if outs.step is not None:
            s, ss = outs.step, outs.scheduler_stats
            it = IterationStats(num_running=ss.num_running, num_waiting=ss.num_waiting,
                                kv_cache_usage=s.kv_cache_usage,
                                num_prompt_tokens=s.num_prefill_tokens,
                                num_generation_tokens=s.num_generation_tokens,
                                num_batched_tokens=s.num_batched_tokens,
                                num_preemptions=s.num_preemptions, ttfts=ttfts, itls=itls,
                                step_s=s.step_s, forward_s=s.forward_s, start_time=s.start_time,
                                kv_transfer_s=self._kv_transfer_s,
                                num_sequences=s.num_sequences,
                                num_attention_pairs=s.num_attention_pairs,
                                num_kv_tokens_read=s.num_kv_tokens_read)
            self._kv_transfer_s, self._pending_ttfts, self._pending_itls = [], [], []
            if s.num_draft_tokens:
                it.spec_decoding = SpecDecodingStats()
                for o in outs.outputs:
                    it.spec_decoding.observe(o.num_draft_tokens, o.num_accepted_draft_tokens)
        return ProcessedOutputs(results, to_abort, it, finished)

    def _advance(self, st: RequestState, o: EngineCoreOutput):
        """Feed the new tokens to the detokenizer; returns (tokens kept, text delta, finish
        reason or None, error)."""
        if o.error:
            return [], "", "abort", o.error
        d = st.detok
        kept: list[int] = []
        parts: list[str] = []
        reason = o.finish_reason
        hidden = o.stop_reason  # EOS / a stop token id: counted, never shown as text
        for i, tok in enumerate(o.new_token_ids):
            last = i == len(o.new_token_ids) - 1
            kept.append(tok)
            if d is None:
                continue
            show = None if (last and hidden is not None) else tok
            parts.append(d.add_token(show, finished=last and reason is not None))
            if d.stopped:  # a stop string matched: nothing after this token counts
                reason = "stop"
                break
        if not o.new_token_ids and reason is not None and d is not None:
            parts.append(d.add_token(None, finished=True))  # flush what was held back
        st.output_token_ids += kept
        return kept, "".join(parts), reason, None

    def _output(self, st: RequestState, delta: str, new_ids: list[int], finished: bool,
                reason: str | None, error: str | None,
                bad_request: bool = False) -> RequestOutput:
        first = not st.sent_first and (bool(new_ids) or finished)
        if first:
            st.sent_first = True
        return RequestOutput(
            prompt_logprobs=st.prompt_logprobs if first else None,
            prompt_token_ids=st.request.prompt_token_ids if first else None,
            request_id=st.request.request_id, new_text=delta, new_token_ids=new_ids,
            text=st.detok.text if st.detok else "", token_ids=list(st.output_token_ids),
            finished=finished, finish_reason=reason,
            stop_reason=st.detok.matched if finished and st.detok else None,
            num_prompt_tokens=len(st.request.prompt_token_ids),
            num_output_tokens=len(st.output_token_ids),
            num_cached_tokens=st.num_cached_tokens, error=error,
            bad_request=bad_request)

    @staticmethod
    def _finished_stats(st: RequestState, reason: str, now: float,
                        first_scheduled: float | None) -> FinishedRequestStats:
        arrival = st.request.arrival_time
        e2e = now - arrival
        ttft = None if st.first_token_time is None else st.first_token_time - arrival
        # first_scheduled is None where the front end finished the request (a client gone): when
        # the core first scheduled it is not known here, so neither are its queue and prefill
        # times (taking `now` for it had made the prefill time negative)
        sched = first_scheduled
        return FinishedRequestStats(
            finish_reason=reason, num_prompt_tokens=len(st.request.prompt_token_ids),
            num_generation_tokens=len(st.output_token_ids), e2e_latency=e2e,
            queue_time=None if sched is None else max(0.0, sched - arrival), ttft=ttft,
            tpot=tpot(e2e, ttft, len(st.output_token_ids)),
            prefill_time=(None if st.first_token_time is None or sched is None
                          else max(0.0, st.first_token_time - sched)),
            decode_time=None if st.first_token_time is None else now - st.first_token_time)
