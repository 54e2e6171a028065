"""The CPUs this process may use, and how many compute threads the engine runs on them (no
torch: the API process uses this module too).

:func:`cpu_budget`: as many threads as the CPUs the process may use, the smaller of its affinity
mask (``os.sched_getaffinity``, what ``taskset`` or a cpuset leaves it) and its cgroup CPU
quota rounded up (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: a
container limited to 1.5 CPUs runs 2 threads), unless ``--num-threads`` or ``OMP_NUM_THREADS``
says otherwise; the count and where it came from are part of the engine's ``cpu:`` log line
(``sloserve.platform``).

:func:`engine_core_env`: the engine-core process starts with OpenMP's busy-wait bounded.
``sloserve.worker.threads`` then runs one thread fewer while other processes hold the cores.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

#: where the cgroup file systems are mounted (cgroup v2 there; v1 controllers under it)
CGROUP_ROOT = "/sys/fs/cgroup"
#: the v1 mount folders that may hold the cpu controller
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def parse_cpu_max(text: str) -> float | None:
    """CPUs a cgroup v2 ``cpu.max`` allows (``"200000 100000"``: 2.0; ``"max 100000"``: None,
    no limit); None for text it cannot read."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """CPUs a cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` pair allows (quota -1:
    None, no limit); None for text it cannot read."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _and_parents(top: str, path: str) -> list[str]:
    """``top`` joined with ``path`` and with each of its parents, down to ``top`` itself."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [os.path.join(top, *parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_quota(root: str = CGROUP_ROOT,
                     self_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup quota allows, the tightest of its cgroup and their parents
    (v2 ``cpu.max`` under ``root``; v1 ``cpu.cfs_*`` under ``root/cpu`` or ``root/cpu,cpuacct``);
    None when no quota is set or none can be read. ``self_cgroup`` (``/proc/self/cgroup``) names
    the process's cgroup; a container sees its own at ``root`` (missing folders are skipped)."""
    v2_path = v1_path = "/"
    for line in (_read(self_cgroup) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            v2_path = path or "/"
        elif "cpu" in controllers.split(","):
            v1_path = path or "/"
    limits = []
    for d in _and_parents(root, v2_path):
        text = _read(os.path.join(d, "cpu.max"))
        if text is not None and (q := parse_cpu_max(text)) is not None:
            limits.append(q)
    for v1 in _V1_CPU_DIRS:
        for d in _and_parents(os.path.join(root, v1), v1_path):
            quota, period = (_read(os.path.join(d, f)) for f in ("cpu.cfs_quota_us",
                                                                  "cpu.cfs_period_us"))
            if quota is not None and period is not None and (q := parse_cfs(quota, period)):
                limits.append(q)
    return min(limits) if limits else None


def threads_for(affinity: int, quota: float | None) -> int:
    """Compute threads for ``affinity`` usable CPUs under a quota of ``quota`` CPUs (None: no
    quota): the smaller of the two, the quota rounded up, at least 1."""
    n = max(1, affinity)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return n


@dataclass(frozen=True)
class CpuBudget:
    """How many compute threads the engine runs, and why.

    Attributes:
        threads: the count.
        source: ``"--num-threads"``, ``"OMP_NUM_THREADS"`` (set by the user), ``"detected"``
            (:func:`threads_for` of the two below), or ``"torch"`` (torch already ran fewer:
            its default of one thread per physical core, or ``torch.set_num_threads`` before
            an in-process engine; the worker keeps that count).
        affinity: CPUs in this process's affinity mask.
        quota: CPUs its cgroup quota allows (None: no quota).
    """

    threads: int
    source: str
    affinity: int
    quota: float | None

    def describe(self) -> str:
        """``threads 2 (affinity 2, quota none)``; ``threads 1 (--num-threads; affinity 2, quota
        1.5)`` when set by the user."""
        quota = "none" if self.quota is None else f"{self.quota:g}"
        by = "" if self.source == "detected" else f"{self.source}; "
        return f"threads {self.threads} ({by}affinity {self.affinity}, quota {quota})"


def _omp_num_threads(environ) -> int | None:
    """The first level of ``OMP_NUM_THREADS`` (``"4"`` or ``"4,2"``) when it is a count >= 1."""
    first = (environ.get("OMP_NUM_THREADS") or "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) >= 1 else None


def cpu_budget(num_threads: int | None = None, environ=None, affinity: int | None = None,
               cgroup_root: str = CGROUP_ROOT,
               self_cgroup: str = "/proc/self/cgroup") -> CpuBudget:
    """The engine's thread count: ``num_threads`` (``--num-threads``) if given, else
    ``OMP_NUM_THREADS`` from ``environ`` (default ``os.environ``) if set, else
    :func:`threads_for` of the affinity mask (``os.sched_getaffinity``; ``affinity`` overrides
    it) and the cgroup quota (:func:`cgroup_cpu_quota` of ``cgroup_root``, ``self_cgroup``)."""
    environ = os.environ if environ is None else environ
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            affinity = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, self_cgroup)
    if num_threads:
        return CpuBudget(num_threads, "--num-threads", affinity, quota)
    omp = _omp_num_threads(environ)
    if omp is not None:
        return CpuBudget(omp, "OMP_NUM_THREADS", affinity, quota)
    return CpuBudget(threads_for(affinity, quota), "detected", affinity, quota)


#: libgomp's busy-wait before a waiting thread sleeps, in ``pause`` iterations (tens to
#: hundreds of microseconds), for the engine-core process: libgomp's default (300,000:
#: milliseconds) keeps a thread spinning at every barrier for a partner the OS has descheduled,
#: and after every parallel region on a core other processes (the API server among them) are
#: waiting for; much shorter (1,000) puts the team to sleep in the Python between a decode
#: step's kernels, and each wake-up costs
ENGINE_GOMP_SPINCOUNT = "10000"


def engine_core_env(environ=None) -> dict[str, str]:
    """The environment to start the engine-core process with: ``environ`` (default
    ``os.environ``) plus ``GOMP_SPINCOUNT`` = :data:`ENGINE_GOMP_SPINCOUNT`, unless the user set
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` (libgomp reads them once, when torch loads it)."""
    env = dict(os.environ if environ is None else environ)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = ENGINE_GOMP_SPINCOUNT
    return env
