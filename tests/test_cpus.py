"""The CPUs the engine may use and its thread count (sloserve.cpus): affinity, cgroup quota
(temp-dir fakes of /sys/fs/cgroup), the user's count, the engine core's OpenMP environment."""
from __future__ import annotations

import os

from sloserve.cpus import (ENGINE_GOMP_SPINCOUNT, CpuBudget, cgroup_cpu_quota, cpu_budget,
                           engine_core_env, parse_cfs, parse_cpu_max, threads_for)


def test_cgroup_quota_files_parse_to_cpus():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("50000 200000") == 0.25
    assert parse_cpu_max("") is None and parse_cpu_max("junk 1") is None
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("250000\n", "100000\n") == 2.5
    assert parse_cfs("x", "100000") is None and parse_cfs("100000", "0") is None


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_process_and_its_parents(tmp_path):
    """cgroup v2: ``cpu.max`` at the process's cgroup (from /proc/self/cgroup) and every parent
    up to the root; the tightest wins, and none set is no quota."""
    root, me = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(me, "0::/kubepods/pod1/ctr\n")
    _write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(root), str(me)) is None
    _write(root / "kubepods/pod1/ctr/cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(str(root), str(me)) == 1.5
    _write(root / "kubepods/cpu.max", "100000 100000\n")  # a parent's tighter limit
    assert cgroup_cpu_quota(str(root), str(me)) == 1.0
    # a container with its own cgroup namespace sees "0::/" and its limit at the root
    _write(me, "0::/\n")
    _write(root / "cpu.max", "300000 100000\n")
    assert cgroup_cpu_quota(str(root), str(me)) == 3.0
    # the path named in /proc/self/cgroup missing under the mount: the root's limit still counts
    _write(me, "0::/elsewhere\n")
    assert cgroup_cpu_quota(str(root), str(me)) == 3.0
    assert cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_cgroup_v1_quota(tmp_path):
    root, me = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(me, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(root), str(me)) is None
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(root), str(me)) == 0.5
    other = tmp_path / "cg2"  # the plain "cpu" mount folder
    _write(other / "cpu/cpu.cfs_quota_us", "200000")
    _write(other / "cpu/cpu.cfs_period_us", "100000")
    assert cgroup_cpu_quota(str(other), str(me)) == 2.0


def test_threads_are_the_smaller_of_affinity_and_the_quota_rounded_up():
    assert threads_for(2, None) == 2
    assert threads_for(4, 1.5) == 2
    assert threads_for(4, 2.0) == 2
    assert threads_for(4, 0.5) == 1
    assert threads_for(2, 8.0) == 2
    assert threads_for(0, None) == 1


def test_cpu_budget_prefers_the_users_count(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "150000 100000\n")
    me = tmp_path / "self_cgroup"
    _write(me, "0::/\n")
    kw = dict(affinity=4, cgroup_root=str(root), self_cgroup=str(me))
    b = cpu_budget(None, {}, **kw)
    assert b == CpuBudget(2, "detected", 4, 1.5)
    assert b.describe() == "threads 2 (affinity 4, quota 1.5)"
    assert cpu_budget(3, {"OMP_NUM_THREADS": "1"}, **kw) == CpuBudget(3, "--num-threads", 4, 1.5)
    assert cpu_budget(None, {"OMP_NUM_THREADS": "3,2"}, **kw).threads == 3
    omp = cpu_budget(None, {"OMP_NUM_THREADS": "1"}, **kw)
    assert omp.describe() == "threads 1 (OMP_NUM_THREADS; affinity 4, quota 1.5)"
    assert cpu_budget(None, {"OMP_NUM_THREADS": "lots"}, **kw).source == "detected"
    assert cpu_budget(None, {}, affinity=2, cgroup_root=str(tmp_path / "none"),
                      self_cgroup=str(me)).describe() == "threads 2 (affinity 2, quota none)"


def test_this_process_budget_is_within_its_affinity():
    b = cpu_budget(None, {})
    assert 1 <= b.threads <= b.affinity == len(os.sched_getaffinity(0))


def test_engine_core_env_bounds_the_spin_unless_the_user_chose_a_wait():
    env = engine_core_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": ENGINE_GOMP_SPINCOUNT}
    assert engine_core_env({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}
    assert engine_core_env({"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}


def test_the_engine_core_process_gets_that_environment(monkeypatch):
    """CoreClient starts the engine core with engine_core_env() (no process is started here)."""
    from sloserve.config import EngineConfig
    from sloserve.engine import core_client

    started = []

    class NoProcess:
        returncode = 0

        def __init__(self, args, env=None, **kw):
            started.append((args, env))

        def poll(self):
            return 0

    monkeypatch.setattr(core_client.subprocess, "Popen", NoProcess)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    core_client.CoreClient(EngineConfig()).shutdown()
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    core_client.CoreClient(EngineConfig()).shutdown()
    (args, env), (_, env_user) = started
    assert args[1:4] == ["-P", "-m", "sloserve.engine.core_proc"]
    assert env["GOMP_SPINCOUNT"] == ENGINE_GOMP_SPINCOUNT and env["PATH"] == os.environ["PATH"]
    assert env_user["OMP_WAIT_POLICY"] == "passive" and "GOMP_SPINCOUNT" not in env_user
