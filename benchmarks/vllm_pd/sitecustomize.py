"""Keeps each vLLM P/D server of benchmarks/pd.sh (setup `vllm-pd`) on the CPU `taskset` gave it.

vLLM CPU 0.32's NIXL worker (`kv_connector/v1/nixl/base_worker.py`) calls
`os.sched_setaffinity(0, ...)` on the thread that builds it (the worker's main thread, which
then runs every forward pass) with "the last core of each NUMA node" from
`CpuPlatform.discover_numa_topology`, which reads /sys and ignores the process's affinity
mask. On a one-node, 2-CPU host that is CPU 1 for P and D alike, so P (`taskset -c 0`) would
compute on D's CPU. This clamps `os.sched_setaffinity` to the mask the process started with
(the `taskset` one) and says so on stderr; nothing else changes. pd.sh puts this folder on the
servers' PYTHONPATH, so every Python process of theirs loads it at start-up.
"""
import os
import sys

_START = frozenset(os.sched_getaffinity(0))
_set = os.sched_setaffinity


def _clamped(pid, mask, /):
    want = set(mask)
    keep = (want & _START) or set(_START)
    if keep != want:
        print(f"[pd.sh sitecustomize] pid {os.getpid()}: sched_setaffinity({pid}, "
              f"{sorted(want)}) kept within the start mask: {sorted(keep)}",
              file=sys.stderr, flush=True)
    _set(pid, keep)


os.sched_setaffinity = _clamped
