"""Structured outputs: a JSON schema, JSON, a regex, a choice of strings or an EBNF grammar,
compiled with xgrammar into a per-step token mask (what vLLM and SGLang use).

The front end checks a request's spec with :func:`validate` (parsing only, no tokenizer: a spec
that cannot compile is a 400). The engine core builds one :class:`StructuredOutputManager` and
hands it to the scheduler (which owns it, as vLLM's does); a request whose grammar is still
compiling is not admitted (``ready`` False, see ``Scheduler._must_wait``). Each step the
scheduler fills the bitmask of every sampling request with a grammar (``fill_bitmask``, into
``ScheduledRequest.token_bitmask``, applied by the runner) and advances its matcher with the
accepted tokens (``accept``). The matcher lives with the scheduler's request, so preemption
(recompute) keeps its state: recomputed tokens are not sampled again. A grammar that accepted
its stop token finishes its request (``stop``, also with ``ignore_eos``); one whose mask allows
no token at all (a spec no string satisfies, e.g. the regex ``[^\\s\\S]``) fails that request
alone, as the request's own fault (``bad_request``: the API answers 400; the scheduler finds it
when the first token is sampled, not from the spec).

Compilation is kept away from the step loop (a wide JSON schema compiles for tens of seconds):

* **Where**: in the compile worker (:mod:`sloserve.engine.grammar_worker`), a process started
  at the first compile and kept, at nice 19, so the kernel gives it only the CPU time the step
  loop leaves; it forks a process per compile (milliseconds: xgrammar and the tokenizer are
  loaded once), at most :data:`COMPILE_WORKERS` at once, and one core thread drives each. That
  thread keeps the normal priority: it mostly waits, and a thread at nice 19 that holds the GIL
  when the kernel takes it off the CPU (beside the nice-19 compile it competes with for a
  core) keeps the step loop waiting for the GIL (gaps of 50-100 ms between tokens, measured). The compiled grammar comes back serialized (``CompiledGrammar.serialize_json``) and that
  thread deserializes it. xgrammar 0.2.9's JSON repeats the grammar's shared automaton once per
  rule, so it grows with the square of the rules (a 2,000-property schema: over 1 GB, longer
  to serialize and to load than to compile, and about its size in memory once loaded): a
  grammar whose JSON would be over :data:`TRANSFER_MAX_BYTES`, or that takes over
  :data:`SERIALIZE_CPU_S` of CPU to serialize, is compiled again in the core instead, by a core
  thread at nice 19 (xgrammar's compact form, no copy). Its compile process has shown that it
  compiles within the timeout, so that second compile is bounded.
* **Cancelled**: requests hold their grammar until they finish (``RequestGrammar.release``,
  called by the scheduler for every finish, aborts included). When the last request needing a
  spec is gone, its queued compile is dropped and a running one is stopped by killing its
  process; only the bounded second compile in the core (above) and the loading of a shipped
  grammar run to their end, and their grammar is cached.
* **Bounded**: a compile that takes over ``compile_timeout_s`` of its process's CPU time
  (``--structured-outputs-compile-timeout``; CPU time, not wall time, so a busy server, which
  leaves the low-priority compile little CPU, does not make a grammar fail) is killed, and its
  requests fail with ``bad_request`` (the API answers 400 naming the flag and its value), as do
  later requests with that spec (the failure is cached). Other compiles and requests go on.
* **Shared and cached**: requests with the same spec share one compile; compiled grammars (and
  failures that are the spec's own) are kept per spec, :data:`CACHE_SIZE` of them and at most
  :data:`CACHE_BYTES`, least recently used dropped first. A cache hit is a dict lookup.

The per-client cap on compiles (``--max-pending-compiles-per-client``) lives in the API
process, which knows the clients (:class:`sloserve.engine.admission.CompileSlots`). This module
loads xgrammar only when a grammar is compiled or matched.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from sloserve.engine.grammar_worker import build_grammar as _grammar
from sloserve.engine.grammar_worker import read_frame, send_job, write_frame
from sloserve.engine.grammar_worker import xgrammar_module as _xgr
from sloserve.engine.json_schema_support import schema_problem
from sloserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: compiled grammars kept per core (by spec)
CACHE_SIZE = 256
#: most bytes the cached grammars may take (a deserialized grammar: about its JSON's size)
CACHE_BYTES = 256 * 2 ** 20
#: compiles running at once, each in its own process forked from the compile worker (whose
#: memory, about 300 MB with the torch xgrammar imports, they share until they write)
COMPILE_WORKERS = 4
#: a compiled grammar whose JSON is larger is compiled again in the core instead
TRANSFER_MAX_BYTES = 4 * 2 ** 20
#: CPU seconds a worker may spend serializing a compiled grammar before the core compiles it
SERIALIZE_CPU_S = 2.0
#: how often a worker's CPU time is read while it compiles (s)
POLL_S = 0.05
#: ``--structured-outputs-compile-timeout``'s flag, for messages
TIMEOUT_FLAG = "--structured-outputs-compile-timeout"


def validate(spec: StructuredOutputsParams) -> None:
    """Parse the spec as the core will (no tokenizer needed). Raises ValueError: a spec that
    does not compile, or a JSON schema with a keyword the grammar would silently drop
    (:mod:`sloserve.engine.json_schema_support`)."""
    if spec.json is not None:  # before xgrammar parses it: a deep schema takes long there
        why = schema_problem(json.loads(spec.json))
        if why is not None:
            raise ValueError(f"the JSON schema {why}")
    _grammar(spec)


def timeout_message(timeout_s: float) -> str:
    """Why a request whose grammar compiled too long failed (naming the flag and its value)."""
    return (f"the grammar took over {timeout_s:g} s of CPU time to compile, the limit "
            f"({TIMEOUT_FLAG} {timeout_s:g})")


# job states: waiting for a slot, compiling in its process, serializing there, being loaded by
# the core, waiting for / compiling in the core's own thread, done
QUEUED, COMPILING, SERIALIZING, LOADING, IN_CORE_QUEUED, IN_CORE, DONE = (
    "queued", "compiling", "serializing", "loading", "in-core queued", "in-core", "done")


class _Job:
    """One spec's compile, shared by every request that asks for the spec while it runs."""

    __slots__ = ("key", "spec", "refs", "state", "done", "grammar", "error", "bad_request",
                 "transient", "cancelled", "cost", "pid", "compiled_in")

    def __init__(self, key: str, spec: StructuredOutputsParams):
        self.key, self.spec = key, spec
        self.refs = 0                 # requests holding it (RequestGrammar not released)
        self.state = QUEUED
        self.done = False             # set last: grammar or error is final then
        self.grammar = None           # xgrammar CompiledGrammar
        self.error: str | None = None
        self.bad_request = False      # the failure is the spec's own (over the timeout)
        self.transient = False        # the failure is not the spec's: compile again next time
        self.cancelled = False
        self.cost = 0                 # bytes it takes in the cache
        self.pid: int | None = None   # the process compiling it, while it runs
        self.compiled_in: int | None = None  # the process that compiled it


class RequestGrammar:
    """One request's matcher over a grammar that may still be compiling."""

    def __init__(self, job: _Job, manager: "StructuredOutputManager", vocab_size: int):
        self._job = job
        self._manager = manager
        self._vocab = vocab_size
        self._matcher = None
        self._bitmask = None
        self._released = False

    @property
    def ready(self) -> bool:
        """Compiled (or failed: see :attr:`error`)."""
        return self._job.done

    @property
    def error(self) -> str | None:
        return self._job.error if self._job.done else None

    @property
    def bad_request(self) -> bool:
        """The failure is the request's own (its grammar compiled over the timeout)."""
        return self._job.done and self._job.bad_request

    @property
    def compiled_in(self) -> int | None:
        """The process id that compiled the grammar (a compile process's, or the core's)."""
        return self._job.compiled_in

    def release(self) -> None:
        """The request is finished: a compile no other request waits for stops (idempotent)."""
        if not self._released:
            self._released = True
            self._manager._release(self._job)

    def _m(self):
        if self._matcher is None:
            xgr = _xgr()
            self._matcher = xgr.GrammarMatcher(self._job.grammar)
            self._bitmask = xgr.allocate_token_bitmask(1, self._vocab)
        return self._matcher

    def fill_bitmask(self) -> bytes:
        """The tokens allowed next, as ``ScheduledRequest.token_bitmask`` expects."""
        m = self._m()
        m.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().tobytes()

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (then the
        matcher is unchanged)."""
        return bool(self._m().accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (draft tokens checked for their masks)."""
        if num_tokens:
            self._m().rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class _Slot:
    """A core thread that runs one compile at a time in a process of the compile worker."""

    def __init__(self, index: int):
        self.index = index
        self.job: _Job | None = None
        self.thread: threading.Thread | None = None


class _Worker:
    """The compile worker process and the core's end of its socket."""

    def __init__(self, proc: subprocess.Popen, sock):
        self.proc, self.sock = proc, sock
        self.send_lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.sock.close()


class _WorkerDied(Exception):
    pass


class StructuredOutputManager:
    """Compiles grammars for the engine core, off its step loop and out of its process (see
    the module docstring).

    Args:
        model, load_format: where the compile worker loads the model's tokenizer from (the
            first one only: a worker started after one died gets xgrammar's tokenizer
            information from the core).
        vocab_size: the model's vocabulary (logits columns; may exceed the tokenizer's).
        compile_timeout_s: most CPU seconds a compile may take (0: no limit).
        workers: most compiles at once (each in its own process).
    """

    def __init__(self, model: str | None, load_format: str, vocab_size: int,
                 compile_timeout_s: float = 30.0, workers: int = COMPILE_WORKERS):
        self.model, self.load_format = model, load_format
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.workers = workers
        self.transfer_max_bytes = TRANSFER_MAX_BYTES
        self.serialize_cpu_s = SERIALIZE_CPU_S
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._cache: collections.OrderedDict[str, _Job] = collections.OrderedDict()
        self._cache_bytes = 0
        self._queue: collections.deque[_Job] = collections.deque()
        self._slots: list[_Slot] = []
        self._w: _Worker | None = None
        self._worker_lock = threading.Lock()  # starts the worker
        self._in_core: collections.deque[_Job] = collections.deque()
        self._in_core_thread: threading.Thread | None = None
        self._active = 0  # jobs queued or compiling
        self._closed = False
        self._init_error: str | None = None  # no xgrammar or no tokenizer: every job fails
        self._info_json: str | None = None   # xgrammar TokenizerInfo, from the first worker
        self._core_info = None
        self._core_compiler = None
        self._core_lock = threading.Lock()

    # ------------------------------------------------------------------ the step loop's side
    def grammar_for(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A new matcher for one request (the compile is shared by every request with the same
        spec, and cached). The request must ``release`` it when it finishes."""
        key = spec.key
        with self._lock:
            job = self._cache.get(key)
            if job is None or (job.done and job.transient):
                if job is not None:
                    self._forget(job)
                job = self._cache[key] = _Job(key, spec)
                self._active += 1
                if self._init_error is not None:
                    self._finish(job, error=self._init_error, transient=False)
                else:
                    self._queue.append(job)
                    self._grow()
                    self._cv.notify()
            else:
                self._cache.move_to_end(key)
            if not job.done:
                job.refs += 1
        return RequestGrammar(job, self, self.vocab_size)

    def _release(self, job: _Job) -> None:
        with self._lock:
            if job.done:
                return
            job.refs -= 1
            if job.refs > 0 or job.cancelled:
                return
            if job.state in (QUEUED, IN_CORE_QUEUED):
                (self._queue if job.state == QUEUED else self._in_core).remove(job)
            elif job.state in (COMPILING, SERIALIZING):
                self._kill_job(job)  # its slot's thread sees the process die
            else:  # LOADING, IN_CORE: bounded (it compiled in time); its grammar is cached
                return
            job.cancelled = True
            logger.info("grammar compile cancelled (%s): no request needs it any more",
                        job.state)
            self._finish(job, error="cancelled: no request needs this grammar", transient=True)

    @property
    def num_compiles(self) -> int:
        """Grammars compiling or waiting to (0 when no compile work remains)."""
        return self._active

    @property
    def cpus_busy(self) -> int:
        """CPUs the compiles hold now: one per compile running (at most :attr:`workers` at
        once, plus the core's own second compile); the engine's compute team leaves them."""
        return min(self._active, self.workers + 1)

    def worker_pids(self) -> list[int]:
        """The compile worker's process id and those of the compiles running (for tests and
        diagnostics)."""
        with self._lock:
            w = [self._w.proc.pid] if self._w is not None and self._w.alive else []
            return w + [s.job.pid for s in self._slots if s.job is not None and s.job.pid]

    def shutdown(self) -> None:
        """Stop the worker and every compile, and drop what is queued (idempotent)."""
        with self._lock:
            self._closed = True
            for s in self._slots:
                if s.job is not None:
                    self._kill_job(s.job)
            for q in (self._queue, self._in_core):
                while q:
                    self._finish(q.popleft(), error="the engine is shutting down",
                                 transient=True)
            self._cv.notify_all()
            w = self._w
        if w is not None:
            w.stop()

    # ------------------------------------------------------------------ bookkeeping (locked)
    def _grow(self) -> None:
        """Start another slot (a core thread driving one compile process at a time) when every
        one is busy and a job waits."""
        idle = sum(1 for s in self._slots if s.job is None)
        if idle < len(self._queue) and len(self._slots) < self.workers:
            slot = _Slot(len(self._slots))
            self._slots.append(slot)
            slot.thread = threading.Thread(target=self._run_slot, args=(slot,), daemon=True,
                                           name=f"sloserve-grammar-{slot.index}")
            slot.thread.start()

    def _finish(self, job: _Job, grammar=None, error: str | None = None,
                bad_request: bool = False, transient: bool = False, cost: int = 0) -> None:
        if job.done:
            return
        job.grammar, job.error, job.bad_request, job.transient = grammar, error, bad_request, transient
        job.state, job.pid = DONE, None
        job.done = True
        self._active -= 1
        if transient or job.cancelled:
            self._forget(job)
            return
        if self._cache.get(job.key) is job:
            job.cost = max(cost, len(job.key))
            self._cache_bytes += job.cost
            self._evict()

    def _forget(self, job: _Job) -> None:
        if self._cache.get(job.key) is job:
            del self._cache[job.key]
            if job.done:
                self._cache_bytes -= job.cost

    def _evict(self) -> None:
        while len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_BYTES:
            victim = next((j for j in self._cache.values() if j.done), None)
            if victim is None:
                return
            self._forget(victim)

    # ------------------------------------------------------------------ worker slots
    def _run_slot(self, slot: _Slot) -> None:
        _import_xgrammar()  # at the normal priority, for good (module docstring, "Where")
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.state, slot.job = COMPILING, job
            try:
                fd = self._start(job)
                if fd is not None:
                    try:
                        self._watch(job, fd)
                    finally:
                        os.close(fd)
            except _WorkerDied as e:
                logger.error("grammar compile worker: %s", e)
                with self._lock:
                    self._finish(job, error=str(e), transient=True)
            except Exception as e:  # noqa: BLE001 - never lose the slot; the job fails alone
                logger.exception("grammar compile failed")
                self._kill_job(job)
                with self._lock:
                    self._finish(job, error=f"grammar compile failed: {type(e).__name__}: {e}",
                                 transient=True)
            finally:
                with self._lock:
                    slot.job = None

    def _start(self, job: _Job) -> int | None:
        """Have the worker fork a process for ``job``; the read end of its result pipe (None
        when structured outputs are unavailable: the job is failed)."""
        worker = self._worker()
        if worker is None:
            with self._lock:
                self._finish(job, error=self._init_error)
            return None
        r, w = os.pipe()
        try:
            with worker.send_lock:
                send_job(worker.sock, {"op": "compile", "spec": _spec_dict(job.spec),
                                       "max_bytes": self.transfer_max_bytes}, w)
        except OSError:
            os.close(r)
            raise _WorkerDied("the grammar compile worker is gone") from None
        finally:
            os.close(w)
        return r

    def _worker(self) -> _Worker | None:
        """The compile worker, started (or restarted, if it died) now; None when it cannot
        work (no xgrammar, no tokenizer: ``_init_error``). Raises _WorkerDied."""
        with self._worker_lock:
            if self._init_error is not None:
                return None
            w = self._w
            if w is not None and w.alive:
                return w
            if w is not None:
                logger.warning("the grammar compile worker died (exit code %s); starting "
                               "another", w.proc.returncode)
                w.stop()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                proc = subprocess.Popen([sys.executable, "-m", "sloserve.engine.grammar_worker",
                                         str(theirs.fileno())], pass_fds=[theirs.fileno()])
            finally:
                theirs.close()
            w = _Worker(proc, ours)
            with self._lock:
                if self._closed:
                    w.stop()
                    raise _WorkerDied("the engine is shutting down")
                self._w = w
            try:
                write_frame(ours.fileno(), {
                    "op": "init", "model": self.model, "load_format": self.load_format,
                    "vocab_size": self.vocab_size, "tokenizer_info": self._info_json})
                msg = read_frame(ours.fileno())
            except OSError:
                msg = None
            if msg is None:
                w.stop()
                raise _WorkerDied(f"the grammar compile worker exited while starting (exit "
                                  f"code {proc.returncode})")
            if msg.get("error"):
                self._init_error = f"structured outputs are unavailable: {msg['error']}"
                logger.error("%s", self._init_error)
                w.stop()
                return None
            if msg.get("tokenizer_info") and self._info_json is None:
                self._info_json = msg["tokenizer_info"]
            logger.info("grammar compile worker started (pid %d, nice 19)", proc.pid)
            return w

    def _kill_job(self, job: _Job) -> None:
        """Stop ``job``'s process now (a no-op once it ended)."""
        pid = job.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # already gone
                pass

    def _watch(self, job: _Job, fd: int) -> None:
        """Follow ``job``'s process: its frames, its CPU time, the job's cancellation; load the
        result or hand the job to the core's own compile."""
        msg = read_frame(fd)
        if msg is None or msg.get("op") != "started":
            raise _WorkerDied("the grammar compile worker could not start a compile")
        with self._lock:
            job.pid = msg["pid"]
            job.compiled_in = job.pid
            if job.cancelled:  # released while the process started
                self._kill_job(job)
        clock = _CpuClock(job.pid)
        limit = self.compile_timeout_s
        compiled_at: float | None = None
        while True:
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if ready:
                msg = read_frame(fd)
                with self._lock:
                    if msg is None or msg["op"] != "compiled":
                        job.pid = None  # it ended: never signal that pid again
                    if job.cancelled:  # killed by _release (or it ended meanwhile): done
                        return
                    if msg is not None and msg["op"] == "compiled":
                        job.state = SERIALIZING
                    elif msg is not None and msg["op"] == "grammar":
                        job.state = LOADING
                if msg is None:
                    with self._lock:
                        self._finish(job, error="the grammar compile process died",
                                     transient=True)
                    return
                op = msg["op"]
                if op == "compiled":
                    compiled_at = clock.seconds()
                elif op == "grammar":
                    self._load(job, msg["json"])
                    return
                elif op == "too_large":
                    logger.info("grammar compiled in %.1f s of CPU; its JSON (%d MB) is over %d "
                                "MB: compiled again in the core", compiled_at or 0,
                                msg["bytes"] >> 20, self.transfer_max_bytes >> 20)
                    self._to_core(job)
                    return
                else:  # "error": the spec does not compile
                    with self._lock:
                        self._finish(job, error=msg.get("message", "unknown error"))
                    return
                continue
            used = clock.seconds()
            if compiled_at is None and limit and used > limit:
                with self._lock:
                    self._kill_job(job)
                    job.pid = None
                    self._finish(job, error=timeout_message(limit), bad_request=True)
                logger.warning("grammar compile over %g s of CPU time: killed", limit)
                return
            if compiled_at is not None and used - compiled_at > self.serialize_cpu_s:
                with self._lock:
                    self._kill_job(job)
                    job.pid = None
                logger.info("grammar compiled in %.1f s of CPU; serializing it takes over %g "
                            "s: compiled again in the core", compiled_at, self.serialize_cpu_s)
                self._to_core(job)
                return

    def _load(self, job: _Job, text: str) -> None:
        """Deserialize a worker's grammar (in the slot's low-priority thread)."""
        xgr = _xgr()
        try:
            grammar = xgr.CompiledGrammar.deserialize_json(text, self._tokenizer_info())
        except Exception:  # noqa: BLE001 - a format the core cannot read: compile it here
            logger.exception("cannot load a compiled grammar; compiling it in the core")
            self._to_core(job)
            return
        with self._lock:
            self._finish(job, grammar=grammar, cost=len(text))

    # ------------------------------------------------------------------ the core's own compile
    def _to_core(self, job: _Job) -> None:
        with self._lock:
            if job.done:
                return
            if job.refs <= 0:
                job.cancelled = True
                self._finish(job, error="cancelled: no request needs this grammar",
                             transient=True)
                return
            job.state, job.pid = IN_CORE_QUEUED, None
            self._in_core.append(job)
            if self._in_core_thread is None:
                self._in_core_thread = threading.Thread(target=self._run_in_core, daemon=True,
                                                        name="sloserve-grammar-core")
                self._in_core_thread.start()
            self._cv.notify_all()

    def _run_in_core(self) -> None:
        _import_xgrammar_then_lower_priority()
        while True:
            with self._cv:
                while not self._in_core and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._in_core.popleft()
                job.state, job.compiled_in = IN_CORE, os.getpid()
            try:
                grammar = self._compiler().compile_grammar(_grammar(job.spec))
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self._finish(job, error=f"{type(e).__name__}: {e}")
                continue
            with self._lock:
                self._finish(job, grammar=grammar, cost=grammar.memory_size_bytes)

    def _tokenizer_info(self):
        with self._core_lock:
            if self._core_info is None:
                self._core_info = _xgr().TokenizerInfo.deserialize_json(self._info_json)
            return self._core_info

    def _compiler(self):
        info = self._tokenizer_info()
        with self._core_lock:
            if self._core_compiler is None:
                self._core_compiler = _xgr().GrammarCompiler(info, max_threads=1,
                                                             cache_enabled=False)
            return self._core_compiler


def _spec_dict(spec: StructuredOutputsParams) -> dict:
    return {k: v for k, v in (("json", spec.json), ("json_object", spec.json_object),
                              ("regex", spec.regex), ("choice", spec.choice),
                              ("grammar", spec.grammar)) if v is not None and v is not False}


def _import_xgrammar() -> None:
    """Import xgrammar (the core needs it to load and match grammars) if it is there."""
    try:
        _xgr()
    except ValueError:  # no xgrammar: the compile worker says so, and every job fails
        pass


def _import_xgrammar_then_lower_priority() -> None:
    """Import xgrammar at the thread's normal priority, then give the thread nice 19.
    Importing is Python work that holds the GIL for a second or so: at nice 19 on a busy host
    the thread could hold it while the kernel keeps it off the CPU, and the step loop would
    wait for it."""
    _import_xgrammar()
    _lower_thread_priority()


def _lower_thread_priority() -> None:
    """Give the calling thread nice 19 (Linux: a thread's nice value is its own)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


class _CpuClock:
    """CPU seconds a process has used since this clock was made (its wall seconds where
    ``/proc`` cannot tell)."""

    _TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, pid: int):
        self.path = f"/proc/{pid}/stat"
        self._wall0 = time.monotonic()
        self._cpu0 = self._read()

    def _read(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                s = f.read()
            fields = s[s.rindex(b")") + 2:].split()
            return (int(fields[11]) + int(fields[12])) / self._TICK  # utime + stime
        except (OSError, ValueError, IndexError):
            return None

    def seconds(self) -> float:
        now = self._read() if self._cpu0 is not None else None
        if now is None:
            return time.monotonic() - self._wall0
        return now - self._cpu0
