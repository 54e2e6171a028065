"""The engine's compute threads on shared cores: one fewer while it gets no more CPU than one
fewer would.

The kernels and torch run each op on an OpenMP team whose threads meet at a barrier after every
phase. When another process takes one of the cores, the team's thread there is descheduled for
whole time slices and every barrier waits for it, or the OS puts both of our threads on the one
free core, where they take turns; and where the scheduler shares the CPUs between processes
(cgroups, session autogroups) a second thread gets the process no more CPU time at all. The
team then runs slower than one thread alone would. So the worker watches what its threads get
(:class:`ThreadGovernor`), per window of :data:`WINDOW_S` seconds of stepping, from the
kernel's per-thread accounting (``/proc/self/task/*/schedstat``: time on a CPU, time runnable
but waiting for one) and the idle time of the CPUs it may use (``/proc/stat``):

* the threads waited :data:`CONTENDED` or more (in threads: 0.5 is one thread waiting half the
  time): a trial with one thread fewer for one window;
* a team of ``n`` keeps its ``n``-th thread only if that thread earns its place: the team's CPU
  time exceeds the smaller team's by at least :data:`EARN` of what each thread of the smaller
  team gets (two threads must get 1.4x one thread's CPU time); a trial compares the window
  before with the window after the change and keeps the better team;
* below the count it started with: one thread more at once when :data:`RAISE_IDLE` CPUs sat
  idle over a window, else a trial every :data:`PROBE_S` seconds;
* a trial that did not change the team doubles the wait before the next one of its kind, up to
  :data:`MAX_PROBE_S`.

The engine's own background work is not left to the measurement: while the engine core has
grammars compiling (each a CPU-bound process or thread at nice 19) it calls :meth:`reserve`
with their count, and the team drops at once to one thread fewer per compile (at least one),
and goes back to the count it had when they end. Measured (2 vCPUs, a nice-19 busy loop in the
engine's own session, the 135M model, batch-1 decode steps): a team of two steps at a quiet
median but a P99 of 87-100 ms (quiet: 5.5 ms), a team of one at P99 10-14 ms; a window of
measurement would come too late for a compile's first seconds.

It never adds threads beyond the count the worker started with and never runs against
``--num-threads`` or ``OMP_NUM_THREADS`` (``sloserve.cpus.cpu_budget``); it needs the kernel's
accounting (off without it).
A window that spans an idle gap between steps is dropped.
"""
from __future__ import annotations

import glob
import logging
import os
import time
from collections import deque
from typing import Callable

logger = logging.getLogger(__name__)

#: seconds of stepping per window
WINDOW_S = 0.5
#: threads waiting for a CPU (run delay / window) from which a team tries one thread fewer
CONTENDED = 0.3
#: the n-th thread stays if the team's CPU time exceeds the (n-1)-team's by this share of
#: what each thread of the smaller team gets
EARN = 0.4
#: idle CPUs (of those the process may use, averaged over a window) that add a thread at once
RAISE_IDLE = 0.5
#: seconds before the first trial of a kind is repeated; doubled after each that changed
#: nothing, up to MAX_PROBE_S
PROBE_S = 10.0
MAX_PROBE_S = 160.0

#: thread id -> (seconds on a CPU, seconds runnable but waiting), cumulative
Threads = dict[int, tuple[float, float]]


def read_threads(task_dir: str = "/proc/self/task") -> Threads | None:
    """Each of the process's threads' time on a CPU and time waiting for one (``schedstat``);
    None where the kernel does not report it."""
    out: Threads = {}
    for path in glob.glob(os.path.join(task_dir, "*", "schedstat")):
        try:
            with open(path, encoding="ascii") as f:
                on_cpu, waiting = f.read().split()[:2]
            out[int(os.path.basename(os.path.dirname(path)))] = (int(on_cpu) / 1e9,
                                                                 int(waiting) / 1e9)
        except (OSError, ValueError):  # a thread that just ended
            continue
    return out or None


def read_idle(cpus, stat: str = "/proc/stat") -> float | None:
    """Seconds the CPUs ``cpus`` have been idle (idle + iowait, summed); None if unreadable."""
    try:
        with open(stat, encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            fields = line.split()
            if int(fields[0][3:]) in cpus:
                ticks += int(fields[4]) + int(fields[5])
    return ticks / os.sysconf("SC_CLK_TCK")


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def earns_its_place(n: int, cpu_n: float, cpu_fewer: float) -> bool:
    """Whether a team of ``n`` threads that got ``cpu_n`` CPUs (CPU seconds per second) beats
    one of ``n - 1`` that got ``cpu_fewer``: its CPU time exceeds the smaller team's by at
    least :data:`EARN` of the smaller team's per-thread share."""
    return cpu_n - cpu_fewer >= EARN * cpu_fewer / max(1, n - 1) - 1e-9


class ThreadGovernor:
    """Adjusts the compute threads between 1 and ``max_threads`` from what they get (see the
    module's docstring); call :meth:`after_step` after every engine step.

    Args:
        max_threads: the count the engine started with (never exceeded).
        set_threads: applies a count (torch's and the kernels' OpenMP threads).
        clock, read_threads_s, read_idle_s: the time source (``time.monotonic``) and the
            readings (:func:`read_threads`, :func:`read_idle` of the affinity mask; None:
            unavailable), injectable for tests.
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], *,
                 clock: Callable[[], float] = time.monotonic,
                 read_threads_s: Callable[[], Threads | None] = read_threads,
                 read_idle_s: Callable[[], float | None] | None = None):
        self.max_threads = self.threads = max_threads
        self._set = set_threads
        self._clock = clock
        self._read_threads = read_threads_s
        if read_idle_s is None:
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
            read_idle_s = lambda: read_idle(cpus)  # noqa: E731
        self._read_idle = read_idle_s
        self.enabled = max_threads > 1 and read_threads_s() is not None
        #: the most threads while :meth:`reserve`'s CPUs are held, and the count before
        self.cap = max_threads
        self._before_reserve: int | None = None
        self._wait = {"down": PROBE_S, "up": PROBE_S}     # seconds between trials of a kind
        self._next = {"down": 0.0, "up": 0.0}             # the earliest time of the next one
        self._trial: tuple[str, int, float] | None = None  # (kind, count before, its CPUs)
        self._start: tuple[float, Threads | None, float | None] | None = None
        self._last = 0.0
        #: (time, old count, new count, why) of the latest changes
        self.changes: deque[tuple[float, int, int, str]] = deque(maxlen=64)

    def after_step(self, started: float) -> None:
        """Account the step that ran from ``started`` (the clock's time) until now; decide once
        per :data:`WINDOW_S` of stepping."""
        if not self.enabled:
            return
        now = self._clock()
        if self._start is None or started - self._last > WINDOW_S:  # the first step, or one
            self._start = self._reading(now)                       # after an idle gap
            if self._trial is not None:
                self._take_back(now, "an idle gap")
        elif now - self._start[0] >= WINDOW_S:
            t0, th0, i0 = self._start
            end = self._reading(now)
            _, th1, i1 = end
            if th0 is None or th1 is None:
                self.enabled = False
                return
            span = now - t0
            both = th0.keys() & th1.keys()
            cpu = sum(th1[t][0] - th0[t][0] for t in both) / span
            waiting = sum(th1[t][1] - th0[t][1] for t in both) / span
            idle = (i1 - i0) / span if i1 is not None and i0 is not None else None
            self.decide(cpu, waiting, idle, now)
            self._start = end
        self._last = now

    def _reading(self, now: float) -> tuple[float, Threads | None, float | None]:
        return now, self._read_threads(), self._read_idle()

    def decide(self, cpu: float, waiting: float, idle: float | None, now: float) -> None:
        """One window's decision: the threads got ``cpu`` CPUs and waited ``waiting`` (both in
        CPU seconds per second), ``idle`` CPUs of the affinity mask sat idle (None: unknown)."""
        n = self.threads
        if self._trial is not None:  # the window after a trial's change: keep the better team
            kind, before, cpu_before = self._trial
            why = f"{cpu_before:.2f} CPUs with {_threads(before)}, {cpu:.2f} with {n}"
            more, cpu_more, cpu_fewer = ((before, cpu_before, cpu) if kind == "down"
                                         else (n, cpu, cpu_before))
            if earns_its_place(more, cpu_more, cpu_fewer) == (kind == "up"):
                self._trial = None
                self._wait[kind], self._next[kind] = PROBE_S, now + PROBE_S
                if kind == "down":  # the next trial with one more after its own wait
                    self._next["up"] = max(self._next["up"], now + self._wait["up"])
                logger.info("compute threads %d -> %d: %s", before, n, why)
            else:
                self._take_back(now, why)
        elif n > 1 and waiting >= CONTENDED and now >= self._next["down"]:
            self._trial = ("down", n, cpu)
            self._change(n - 1, now, f"trial: the threads waited for a CPU {waiting:.2f} of "
                                     f"the time")
        elif n < self.cap and idle is not None and idle >= RAISE_IDLE:
            self._change(n + 1, now, f"{idle:.2f} CPUs idle", logger.info)
            self._wait["up"], self._next["up"] = PROBE_S, now + PROBE_S
        elif n < self.cap and now >= self._next["up"]:
            self._trial = ("up", n, cpu)
            self._change(n + 1, now, "trial")

    def reserve(self, cpus: int, why: str = "grammar compiles") -> None:
        """Leave ``cpus`` CPUs to the engine's own background work (``why``): at most
        ``max_threads - cpus`` threads (at least one) until the next call; 0 gives them back
        (the count before the reservation). A trial under way is undone."""
        cap = max(1, self.max_threads - max(0, cpus))
        if cap == self.cap:
            return
        now = self._clock()
        settled = self.threads if self._trial is None else self._trial[1]  # a trial's is undone
        self._trial = None
        self._start = None  # the next window starts with the new team
        if cap < self.cap and self._before_reserve is None:
            self._before_reserve = settled
        self.cap = cap
        target = min(settled, cap)
        if cap == self.max_threads:
            target, self._before_reserve = self._before_reserve or self.threads, None
        if target != self.threads:
            self._change(target, now, f"{cpus} CPU(s) for {why}" if cpus else f"{why} done",
                         logger.info)

    def _take_back(self, now: float, why: str) -> None:
        """Undo the trial's change; its kind waits twice as long before the next one."""
        kind, before, _ = self._trial
        self._trial = None
        self._wait[kind] = min(2 * self._wait[kind], MAX_PROBE_S)
        self._next[kind] = now + self._wait[kind]
        self._change(before, now, f"trial taken back: {why}")

    def _change(self, n: int, now: float, why: str, log=logger.debug) -> None:
        log("compute threads %d -> %d: %s", self.threads, n, why)
        self.changes.append((now, self.threads, n, why))
        self.threads = n
        self._set(n)
