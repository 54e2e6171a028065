"""The async front end of the server: tokenization, validation, detokenization and stop strings
in the API process; the engine core in its own process behind ZeroMQ (``core_client``).

A receiver thread takes each message the core publishes, turns it into per-request outputs
(``OutputProcessor``) and hands them to the requests' asyncio queues with
``call_soon_threadsafe``, so the event loop never waits on the core and any event loop may call
``generate`` (the server's, a test's). Stop strings matched here go back to the core as aborts.
The core's published snapshot (``stats``) is what ``/metrics`` and ``/health`` read.

If the core process dies, every request in flight ends at once with :class:`EngineDeadError`
(HTTP 503 or an SSE error event) and ``is_running`` turns False (``/health`` answers 503).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator

from sloserve.config import EngineConfig
from sloserve.engine.admission import (AdmissionLimits, CompileSlot, CompileSlots, Rejection,
                                       check_arrival)
from sloserve.engine.core_client import CoreClient
from sloserve.engine.messages import (EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest,
                                      EngineCoreResetPrefixCache,
                                      SchedulerStats)
from sloserve.engine.metrics import SpecDecodingLogger, StatLogger, log_stats
from sloserve.engine.output_processor import OutputProcessor
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.processor import Processor
from sloserve.sampling_params import SamplingParams
from sloserve.tokenizer import load_model_tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running (it died, or the front end shut down)."""


class EngineShutdownError(EngineDeadError):
    """The server is shutting down: requests still in flight at the end of the drain."""


class AsyncLLM:
    """Usage:
        engine = AsyncLLM(EngineConfig(...)); engine.start()
        async for out in engine.generate(engine.make_request("Hello", SamplingParams(max_tokens=8))): ...
        engine.shutdown()

    Args:
        config: the engine's settings.
        stat_loggers: get every step's stats (the Prometheus exporter).
        step_trace: the core writes its step trace here.
        log_level: the core process's logging level.

    Raises (constructor): what :class:`CoreClient` raises (a refused model or setting, a core
    that died while starting).
    """

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None,
                 step_trace: str | None = None, log_level: str = "info"):
        self.config = config
        self.admission_limits = AdmissionLimits.of(config)
        #: the per-client cap on grammars compiling (``--max-pending-compiles-per-client``)
        self.compile_slots = CompileSlots(config.max_pending_compiles_per_client)
        self.client = CoreClient(config, step_trace, log_level)
        try:  # the tokenizer loads here while the core loads the weights
            try:
                tokenizer = load_model_tokenizer(config.model, config.load_format)
            except (OSError, ValueError):
                # a model the core's loader refuses too: its message (the same whichever process
                # notices first); a model it loads: the tokenizer's
                self.client.wait_ready()
                raise
            self.info = self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        self.tokenizer = tokenizer
        self.processor = Processor(tokenizer, self.info)
        self.output_processor = OutputProcessor(tokenizer)
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._spec_logger: SpecDecodingLogger | None = None
        spec = config.speculative
        if spec is not None:
            self._spec_logger = SpecDecodingLogger(logger, spec.num_speculative_tokens)
            self.stat_loggers.append(self._spec_logger)
        #: the core's latest published snapshot
        self.stats = SchedulerStats(num_free_blocks=self.info.num_kv_blocks,
                                    num_blocks=self.info.num_kv_blocks)
        self._stats_lock = threading.Lock()  # the receiver thread and aborts both record
        #: overload control's counts (under _admit_lock): requests sent to the core, the
        #: (sequence number, prompt tokens) of those it may not have queued yet, and the places
        #: admitted requests reserved but have not sent yet (``reserve``); the last two count
        #: as waiting
        self._admit_lock = threading.Lock()
        self._sent_total = 0
        self._in_transit: collections.deque = collections.deque()
        self._reserved: list[int] = []  # prompt tokens of each reserved, unsent request
        self._last_step_end = 0.0  # when the core's last step ended (monotonic s)
        #: stall detection (``stalled_for``): when the core was last heard from (any message
        #: after its loop ran) or, if later, when work was sent to a core that had none
        self._heard_at = time.monotonic()
        self._stop = threading.Event()
        self._dead: str | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ what the server reads
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
    def is_running(self) -> bool:
        """The receiver runs and the core process is alive."""
        return bool(self._threads) and self._dead is None and self.client.is_alive

    def stalled_for(self) -> float | None:
        """Seconds the core has had work pending (requests sent and unfinished) without a
        word from its loop (a step's outputs, or the snapshot it publishes after inputs, or the
        heartbeat of a loop with nothing it can run), if that is longer than
        ``--engine-stall-timeout``; None otherwise (and with the timeout 0). A stalled core is
        not a dead one: nothing is failed, and it counts as healthy again at its next
        message."""
        timeout = self.config.engine_stall_timeout
        if not timeout or self.output_processor.num_unfinished == 0:
            return None
        silent = time.monotonic() - self._heard_at
        return silent if silent > timeout else None

    @property
    def num_unfinished(self) -> int:
        """Requests the front end is still waiting on."""
        return self.output_processor.num_unfinished

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the receiver and the core watcher (idempotent)."""
        if self._threads:
            return
        for target, name in ((self._receive_loop, "sloserve-outputs"),
                             (self._watch_core, "sloserve-core-watch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        """Stop the threads and the core process (idempotent)."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self.client.shutdown()
        if self._dead is None:
            self._dead = "the engine was shut down"
        self._fail_all(self._dead)

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None,
                     arrival_time: float | None = None, **kw) -> EngineCoreRequest:
        """Validate and tokenize (raises ParamError) without queueing."""
        return self.processor.make_request(prompt, params, request_id, arrival_time, **kw)

    def reserve(self, requests: list[EngineCoreRequest],
                client: str | None = None) -> "Reservation | Rejection":
        """Overload control at arrival (``engine.admission``) for the engine requests of one API
        request (its ``n`` choices, its prompts): a :class:`Rejection` (nothing reserved), or
        a :class:`Reservation` of one place in the queue for each of them, counted as waiting
        from now until the core reports it queued: whatever arrives meanwhile, a burst
        included, sees it. Pass it to :meth:`generate_group`, which moves each request it
        sends to those on their way; the caller gives the rest back
        (:meth:`Reservation.release`) when its response ends. Reads only the core's published
        snapshot and this process's own counts, so a core busy with a long step does not delay
        the answer.

        ``client`` (the peer address; None: not counted) is checked first against the cap on
        grammars compiling per client when the requests have a structured-output spec
        (:class:`~sloserve.engine.admission.CompileSlots`); the reservation then holds the
        client's slot until the first output or its release."""
        slot = None
        spec = requests[0].sampling_params.structured_outputs if requests else None
        if spec is not None and client is not None:
            got = self.compile_slots.acquire(client, spec.key)
            if isinstance(got, Rejection):
                return got
            slot = got
        if not self.admission_limits.active:
            return Reservation(self, [], slot)
        tokens = [len(r.prompt_token_ids) for r in requests]
        with self._admit_lock:
            s = self.stats
            self._forget_received(s)
            ahead = [n for _, n in self._in_transit] + self._reserved
            # the step in flight (the core starts the next one as soon as it has sent outputs)
            busy = s.num_running + s.num_waiting + len(ahead) > 0
            step_s = s.prefill_step_s if s.num_waiting_tokens or ahead else s.decode_step_s
            wait = max(0.0, step_s - (time.monotonic() - self._last_step_end)) if busy else 0.0
            rej = check_arrival(self.admission_limits, s, tokens, wait, ahead)
            if rej is not None:
                if slot is not None:
                    slot.release()
                return rej
            self._reserved += tokens
            return Reservation(self, tokens, slot)

    def _forget_received(self, s: SchedulerStats) -> None:
        """Drop the requests the core says it has queued from those counted as on their way."""
        while self._in_transit and self._in_transit[0][0] <= s.num_requests_received_total:
            self._in_transit.popleft()

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[RequestOutput]:
        """Send a request made by make_request and yield its outputs until it finishes.

        Leaving the iteration early (the client went away, the task was cancelled) aborts the
        request in the core, which frees its KV blocks before its next step.

        Raises:
            EngineDeadError: the core is not running, or died meanwhile.
            ValueError: a duplicate request id.
        """
        async with contextlib.aclosing(self.generate_group([request])) as outs:
            async for _, out in outs:
                yield out

    async def generate_group(self, requests: list[EngineCoreRequest],
                             reservation: "Reservation | None" = None
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Send several requests (the ``n`` choices or the prompts of one API request) and yield
        (index in ``requests``, output) as outputs arrive, until every one has finished.

        ``reservation``: their places from :meth:`reserve`; each request sent takes its place
        (it stays counted, as on its way to the core). The caller gives back what was not sent
        (:meth:`Reservation.release`) when its response ends, however it ends: a generation
        cancelled before it started runs no code of its own. The first output that is not a
        failure tells the reservation the requests' grammar compiled (it frees the client's
        compile slot).

        Leaving early aborts those not finished. Raises as :meth:`generate`.
        """
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        index = {r.request_id: i for i, r in enumerate(requests)}
        if len(index) != len(requests):
            raise ValueError("duplicate request ids in one group")
        added: list[str] = []
        unfinished: set[str] = set()
        try:
            for r in requests:
                self.output_processor.add_request(r, sink=(loop, q))
                added.append(r.request_id)
                unfinished.add(r.request_id)
            if self.output_processor.num_unfinished == len(requests):
                # work for a core that had none: its stall clock starts now, not at its last
                # message (an idle core sends nothing)
                self._heard_at = max(self._heard_at, time.monotonic())
            for r in requests:  # inside the try: a request that cannot be sent is forgotten
                n = len(r.prompt_token_ids)
                with self._admit_lock:  # sequence numbers in the order the core receives them
                    self.client.send(r)
                    self._sent_total += 1
                    self._forget_received(self.stats)  # also without overload control
                    self._in_transit.append((self._sent_total, n))
                    if reservation is not None and reservation.take(n):
                        self._reserved.remove(n)  # its place: from reserved to on its way
            while unfinished:
                out = await q.get()
                if isinstance(out, BaseException):
                    unfinished.clear()
                    raise out
                if out.finished:
                    unfinished.discard(out.request_id)
                if reservation is not None and not out.error and out.finish_reason != "abort":
                    reservation.grammar_compiled()  # the core ran it: its grammar is ready
                yield index[out.request_id], out
        finally:
            for rid in added:
                if rid in unfinished:
                    self._abort(rid)

    def reset_prefix_cache(self) -> None:
        """Ask the core to forget its prefix cache (applied before its next step)."""
        if self._dead is None:
            self.client.send(EngineCoreResetPrefixCache())

    async def abort(self, request_id: str) -> None:
        """Abort a request (the core frees its blocks before its next step)."""
        self._abort(request_id)

    def _abort(self, rid: str) -> None:
        res = self.output_processor.abort_request(rid, time.monotonic())
        if res is not None:
            self._log_stats(None, [res[1]])  # counted now: no step may follow it
            if self._dead is None:
                self.client.send(EngineCoreAbort([rid]))

    # ------------------------------------------------------------------ threads
    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.client.recv(100)
            except Exception:  # closed sockets at shutdown, a malformed message
                if self._stop.is_set():
                    return
                logger.exception("bad message from the engine core")
                continue
            if self._spec_logger is not None:
                with self._stats_lock:
                    self._spec_logger.tick()
            if isinstance(msg, EngineCoreOutputs):
                try:
                    self._handle(msg)
                except Exception:  # never lose the receiver
                    logger.exception("processing engine outputs failed")

    def _handle(self, msg: EngineCoreOutputs) -> None:
        self._heard_at = time.monotonic()  # the core's loop runs (see stalled_for)
        self.stats = msg.scheduler_stats
        if msg.step is not None:
            self._last_step_end = msg.timestamp  # the core's monotonic clock: same host
        res = self.output_processor.process_outputs(msg, time.monotonic())
        if res.reqs_to_abort:
            self.client.send(EngineCoreAbort(res.reqs_to_abort))
        # recorded before the outputs go out: a client that saw its last token finds it counted
        if res.iteration is not None or res.finished:
            self._log_stats(res.iteration, res.finished)
        self._deliver(res.request_outputs)

    def _log_stats(self, it, finished) -> None:
        with self._stats_lock:
            log_stats(self.stat_loggers, it, finished, logger)

    def _deliver(self, items) -> None:
        """Put outputs on their requests' queues, one wake-up per event loop."""
        by_loop: dict = defaultdict(list)
        for sink, out in items:
            if sink is not None:
                by_loop[sink[0]].append((sink[1], out))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed
                pass

    def _watch_core(self) -> None:
        proc = self.client.proc
        while not self._stop.is_set():
            try:
                proc.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._stop.is_set():
            return
        self._dead = f"the engine core process died (exit code {proc.returncode})"
        logger.error("%s; failing %d requests in flight", self._dead,
                     self.output_processor.num_unfinished)
        self._fail_all(self._dead)
        # nothing runs or waits any more; the cache died with the core
        self.stats = SchedulerStats(num_blocks=self.info.num_kv_blocks)

    def fail_in_flight(self, message: str) -> int:
        """End every request in flight now with EngineShutdownError(message) (the end of a
        drain) and abort them in the core; returns how many there were."""
        items = self.output_processor.fail_all(message)
        if items and self._dead is None:
            self.client.send(EngineCoreAbort([out.request_id for _, out in items]))
        err = EngineShutdownError(message)
        self._deliver([(sink, err) for sink, _ in items])
        return len(items)

    def _fail_all(self, message: str) -> None:
        err = EngineDeadError(message)
        self._deliver([(sink, err) for sink, _ in self.output_processor.fail_all(message)])


class Reservation:
    """Places in the waiting queue that :meth:`AsyncLLM.reserve` admitted for a group of
    engine requests (their prompt token counts), held until each is sent (``take``) or the
    rest is given back (``release``, idempotent; thread-safe through the engine's lock); and
    the client's compile slot, if its requests need a grammar new to the server, held until
    ``grammar_compiled`` or ``release``."""

    def __init__(self, engine: AsyncLLM, tokens: list[int], compile_slot: CompileSlot | None = None):
        self._engine = engine
        self._tokens = list(tokens)
        self._compile_slot = compile_slot

    def grammar_compiled(self) -> None:
        """The requests' grammar is compiled: the client's compile slot is free (idempotent)."""
        if self._compile_slot is not None:
            self._compile_slot.compiled()

    def take(self, prompt_tokens: int) -> bool:
        """One request of ``prompt_tokens`` tokens was sent: whether it held a place here (the
        caller, under the engine's lock, moves it to the requests on their way)."""
        if prompt_tokens in self._tokens:
            self._tokens.remove(prompt_tokens)
            return True
        return False

    def release(self) -> None:
        """Give back the places of the requests not sent, and the compile slot."""
        if self._compile_slot is not None:
            self._compile_slot.release()
        with self._engine._admit_lock:
            for n in self._tokens:
                self._engine._reserved.remove(n)
            self._tokens = []

    def __len__(self) -> int:
        return len(self._tokens)


def _put_all(batch) -> None:
    for q, item in batch:
        q.put_nowait(item)
