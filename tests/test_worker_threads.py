"""The compute-thread governor (sloserve.worker.threads): one thread fewer while the team gets no
more CPU than a smaller one would, one more when CPUs sit idle or a trial shows it pays. A fake
clock and fake kernel accounting: no model, no timing."""
from __future__ import annotations

import os

from sloserve.worker import threads as T
from sloserve.worker.threads import ThreadGovernor, earns_its_place, read_idle, read_threads


class World:
    """What the threads get per second of stepping, as a function of their count:
    ``cpus(n) -> (CPUs on a CPU, CPUs waiting for one, idle CPUs)``; a clock advanced by hand."""

    def __init__(self, cpus):
        self.cpus = cpus
        self.now, self.on_cpu, self.waiting, self.idle = 100.0, 0.0, 0.0, 0.0
        self.applied: list[int] = []

    def governor(self, max_threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, self.applied.append, clock=lambda: self.now,
                              read_threads_s=lambda: {1: (self.on_cpu, self.waiting)},
                              read_idle_s=lambda: self.idle)

    def step(self, g: ThreadGovernor, dt: float) -> None:
        """A step of ``dt`` seconds, with what ``g``'s current count gets."""
        on_cpu, waiting, idle = self.cpus(g.threads)
        started = self.now
        self.now += dt
        self.on_cpu += on_cpu * dt
        self.waiting += waiting * dt
        self.idle += idle * dt
        g.after_step(started)

    def run(self, g: ThreadGovernor, seconds: float) -> list[int]:
        """Back-to-back steps of an eighth of a window (exact in binary) for ``seconds``;
        the thread count after each window."""
        counts = []
        for i in range(int(seconds / T.WINDOW_S) * 8):
            self.step(g, T.WINDOW_S / 8)
            if i % 8 == 7:
                counts.append(g.threads)
        return counts


def test_the_nth_thread_earns_its_place_with_forty_percent_of_a_share():
    assert earns_its_place(2, 1.8, 1.0)        # quiet: two threads, nearly two CPUs
    assert earns_its_place(2, 1.4, 1.0)        # the edge
    assert not earns_its_place(2, 1.39, 1.0)
    assert not earns_its_place(2, 1.0, 1.0)    # both threads on the one free core
    assert earns_its_place(2, 0.55, 0.2)       # every core shared thread by thread
    assert earns_its_place(8, 8.0, 7.0)
    assert not earns_its_place(8, 7.0, 7.0)


def quiet(n):
    return 0.9 * n, 0.0, 2.0 - 0.9 * n


def test_a_quiet_machine_keeps_every_thread():
    w = World(quiet)
    g = w.governor()
    assert g.enabled
    assert set(w.run(g, 60)) == {2} and w.applied == []


def test_a_neighbour_on_one_core_leaves_one_thread_until_it_goes():
    """Two threads on the one free core (1 CPU between them, each waiting half the time) do
    no better than one: one stays; trials with two, taken back, come ever later; once the
    neighbour has gone the idle core brings the second thread back at once."""
    neighbour = True

    def cpus(n):
        if not neighbour:
            return quiet(n)
        return (1.0, 0.9, 0.0) if n == 2 else (1.0, 0.0, 0.0)
    w = World(cpus)
    g = w.governor()
    counts = w.run(g, 200)
    assert counts[:3] == [2, 1, 1]
    trials = [t for t, old, new, why in g.changes if new == 2 and why == "trial"]
    gaps = [round(b - a) for a, b in zip(trials, trials[1:])]
    assert gaps[:3] == [20, 40, 80]  # each taken back after one window
    assert counts.count(1) > 0.95 * len(counts)
    neighbour = False
    assert w.run(g, 2)[-1] == 2
    assert set(w.run(g, 30)) == {2}


def test_a_second_thread_that_gets_more_cpu_stays():
    """Every core shared thread by thread (the neighbours in the same cgroup): two threads get
    0.55 CPUs, one gets 0.2: the trial with one is taken back, and the next one waits longer."""
    w = World(lambda n: (0.55, 0.9, 0.0) if n == 2 else (0.2, 0.8, 0.0))
    g = w.governor()
    counts = w.run(g, 100)
    assert counts.count(2) > 0.95 * len(counts)
    downs = [t for t, old, new, why in g.changes if new == 1]
    assert [round(b - a) for a, b in zip(downs, downs[1:])][:2] == [20, 40]


def test_a_share_per_process_means_one_thread():
    """The scheduler shares the CPUs per process group: two threads get what one gets."""
    w = World(lambda n: (0.66, 0.98, 0.0) if n == 2 else (0.65, 0.34, 0.0))
    g = w.governor()
    counts = w.run(g, 100)
    assert counts[1:3] == [1, 1] and counts.count(1) > 0.95 * len(counts)
    assert all(why.startswith("trial taken back") for t, old, new, why in g.changes
               if old == 2 and new == 1 and t > w.now - 90)  # only trials with two since


def test_never_below_one_nor_above_the_start():
    w = World(lambda n: (0.5, 2.0, 0.0))  # no team gets more than half a CPU
    g = w.governor(max_threads=3)
    assert w.run(g, 100)[-1] == 1
    assert min(w.applied) == 1 and max(w.applied) <= 3
    w.cpus = lambda n: (0.9 * n, 0.0, 3.0 - 0.9 * n)
    assert w.run(g, 2)[-1] == 3


def test_a_gap_between_steps_opens_a_new_window_and_ends_a_trial():
    w = World(lambda n: (1.0, 0.9, 0.0) if n == 2 else (1.0, 0.0, 0.0))
    g = w.governor()
    w.run(g, T.WINDOW_S)
    assert g.threads == 2
    w.run(g, T.WINDOW_S)
    assert g.threads == 1 and g._trial is not None  # the trial's window is under way
    w.now += 30.0
    w.waiting += 30.0  # whatever happened while no step ran: not counted
    w.step(g, 0.1)
    assert g.threads == 2 and g._trial is None


def test_a_long_step_is_a_window_not_a_gap():
    """A step longer than the window (a long prefill on a loaded host) still counts."""
    w = World(lambda n: (1.0, 0.9, 0.0) if n == 2 else (1.0, 0.0, 0.0))
    g = w.governor()
    w.step(g, 0.0)
    w.step(g, 2.0)
    assert g.threads == 1


def test_cpus_reserved_for_compiles_cap_the_team_at_once_and_come_back_after():
    """A reservation (the engine's grammar compiles) drops the team before any window is
    measured; idle CPUs and trials do not raise it above the cap; the count before comes back
    when the reservation ends."""
    w = World(quiet)
    g = w.governor()
    w.run(g, 5)
    g.reserve(1)
    assert w.applied == [1] and g.threads == 1
    assert set(w.run(g, 60)) == {1}  # a CPU and more sat idle every window: still one
    g.reserve(1)
    assert w.applied == [1]
    g.reserve(0)
    assert w.applied == [1, 2] and set(w.run(g, 10)) == {2}


def test_a_reservation_keeps_a_thread_and_restores_what_the_measurement_chose():
    w = World(lambda n: (1.0, 0.9, 0.0) if n > 1 else (1.0, 0.0, 0.0))  # one free core
    g = w.governor(max_threads=4)
    g.reserve(9)
    assert g.threads == 1 and g.cap == 1
    g.reserve(0)
    assert g.threads == 4
    w.run(g, 60)
    settled = g.threads
    assert settled < 4
    g.reserve(1)
    g.reserve(0)
    assert g.threads == settled


def test_a_reservation_undoes_a_trial_under_way():
    w = World(lambda n: (1.0, 0.9, 0.0) if n == 2 else (1.0, 0.0, 0.0))
    g = w.governor()
    w.run(g, 2 * T.WINDOW_S)
    assert g.threads == 1 and g._trial is not None  # a trial with one thread
    g.reserve(1)
    assert g._trial is None and g.threads == 1
    g.reserve(0)
    assert g.threads == 2  # the count the trial started from


def test_off_with_one_thread_or_without_the_accounting():
    w = World(quiet)
    assert not w.governor(max_threads=1).enabled
    g = ThreadGovernor(2, w.applied.append, read_threads_s=lambda: None)
    assert not g.enabled
    g.after_step(0.0)
    assert w.applied == []
    g.reserve(1)  # a reservation needs no measurement
    assert w.applied == [1]


def test_the_readings(tmp_path):
    mine = read_threads()
    assert mine is None or all(on >= 0 and wait >= 0 for on, wait in mine.values())
    idle = read_idle(os.sched_getaffinity(0))
    assert idle is not None and idle >= 0.0
    for tid, text in (("7", "1500000000 2500000000 9\n"), ("8", "3 500000000 1\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(text)
    assert read_threads(str(tmp_path)) == {7: (1.5, 2.5), 8: (3e-9, 0.5)}
    assert read_threads(str(tmp_path / "none")) is None
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4 5 6 7 0 0 0\ncpu0 1 0 1 300 20 0 0 0 0 0\n"
                    "cpu1 1 0 1 100 0 0 0 0 0 0\nintr 5\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert read_idle({0}, str(stat)) == 320 / hz
    assert read_idle({0, 1}, str(stat)) == 420 / hz
