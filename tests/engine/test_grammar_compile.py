"""Grammar compilation is isolated from the engine core's step loop: it runs in processes of the
compile worker at nice 19 (never in the core's process: xgrammar's compile function of this
process, which plays the core, is spied on), a compile no request needs any more has its process
killed, a compile over its CPU-time limit fails its own requests only (and stays failed), and a
grammar too large to ship back is compiled in the core instead. Real xgrammar, real worker processes, the
embedded model's tokenizer; a 2,000-property schema is the slow grammar (tens of seconds of
CPU). Every wait is a hang guard, never a speed bound."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from sloserve.engine.structured_output import StructuredOutputManager
from sloserve.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

SMALL = StructuredOutputsParams(json=json.dumps(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))


def wide(prefix: str, n: int = 2000, required: bool = False) -> StructuredOutputsParams:
    """An object schema of ``n`` integer properties: optional ones compile for tens of seconds
    of CPU; required ones compile fast but serialize to a huge JSON."""
    names = [f"{prefix}{i:04d}" for i in range(n)]
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in names}}
    if required:
        schema["required"] = names
    return StructuredOutputsParams(json=json.dumps(schema))


def wait_until(cond, what: str, timeout: float = 300.0) -> None:
    """Poll ``cond`` (a hang guard: ``timeout`` is not a speed bound)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: still not after {timeout} s"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def manager(gguf_path):
    m = StructuredOutputManager(None, "auto", 49152, compile_timeout_s=0)
    yield m
    m.shutdown()


@pytest.fixture
def core_compiles(monkeypatch):
    """Every call of xgrammar's grammar compile in this process (the engine core's)."""
    import xgrammar
    calls: list = []
    compile_grammar = xgrammar.GrammarCompiler.compile_grammar

    def spy(self, *a, **kw):
        calls.append(a)
        return compile_grammar(self, *a, **kw)
    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", spy)
    return calls


def test_grammars_compile_in_a_low_priority_worker_process_and_are_shared(manager,
                                                                          core_compiles):
    g = manager.grammar_for(SMALL)
    wait_until(lambda: g.ready, "compile")
    assert g.error is None and not g.bad_request
    assert g.compiled_in not in (None, os.getpid())
    [worker] = manager.worker_pids()  # the compile worker; the compile's own process is gone
    assert worker != os.getpid() and os.getpriority(os.PRIO_PROCESS, worker) == 19
    # the core's threads that drive compiles keep this process's priority: a nice-19 thread
    # holding the GIL off the CPU would stall the step loop
    drivers = [t for t in threading.enumerate() if t.name.startswith("sloserve-grammar-")
               and t.name != "sloserve-grammar-core"]
    assert drivers and all(os.getpriority(os.PRIO_PROCESS, t.native_id)
                           == os.getpriority(os.PRIO_PROCESS, 0) for t in drivers)
    assert core_compiles == []  # shipped back serialized, never compiled here
    mask = g.fill_bitmask()
    assert mask.strip(b"\0") and mask.strip(b"\xff")  # some tokens allowed, not all
    h = manager.grammar_for(SMALL)  # a second request: the cached grammar, at once
    assert h.ready and h._job is g._job
    g.release()
    h.release()
    assert manager.num_compiles == 0


def test_a_compile_no_request_waits_for_is_killed(manager, core_compiles):
    a, b = manager.grammar_for(wide("k")), manager.grammar_for(wide("k"))
    assert a._job is b._job and manager.num_compiles == 1  # one compile for both
    wait_until(lambda: a._job.pid is not None, "compile started")
    pid = a._job.pid
    assert pid in manager.worker_pids() and os.getpriority(os.PRIO_PROCESS, pid) == 19
    a.release()  # the other request still needs it
    assert alive(pid) and not b.ready and manager.num_compiles == 1
    b.release()
    assert manager.num_compiles == 0
    wait_until(lambda: not alive(pid), "the compiling worker is gone")
    c = manager.grammar_for(wide("k"))  # nothing of the cancelled compile was kept
    assert not c.ready
    c.release()
    assert manager.num_compiles == 0 and core_compiles == []


def test_a_compile_over_the_timeout_fails_alone_and_stays_failed(manager, core_compiles):
    manager.compile_timeout_s = 0.5
    try:
        slow = manager.grammar_for(wide("t"))
        other = manager.grammar_for(StructuredOutputsParams(regex="[a-z]{3}"))
        wait_until(lambda: slow.ready and other.ready, "compiles")
        assert slow.bad_request and slow.error == (
            "the grammar took over 0.5 s of CPU time to compile, the limit "
            "(--structured-outputs-compile-timeout 0.5)")
        assert other.error is None and not other.bad_request
        again = manager.grammar_for(wide("t"))  # the failure is cached: no second compile
        assert again.ready and again.bad_request and manager.num_compiles == 0
        for g in (slow, other, again):
            g.release()
    finally:
        manager.compile_timeout_s = 0
    assert core_compiles == []


def test_a_grammar_too_large_to_ship_compiles_in_the_core(manager, core_compiles):
    manager.transfer_max_bytes = 1000
    try:
        g = manager.grammar_for(StructuredOutputsParams(choice=["yes", "no"]))
        wait_until(lambda: g.ready, "compile")
    finally:
        manager.transfer_max_bytes = 4 * 2 ** 20
    assert g.error is None and len(core_compiles) == 1 and g.compiled_in == os.getpid()
    assert g.fill_bitmask().strip(b"\0")
    g.release()


def test_a_grammar_slow_to_serialize_compiles_in_the_core(manager, core_compiles):
    """600 required properties compile in a fraction of a second, but xgrammar's JSON of them
    has hundreds of MB (it grows with the square of the rules): the worker is stopped while it
    serializes and the core compiles the grammar itself."""
    manager.serialize_cpu_s = 0.2
    try:
        g = manager.grammar_for(wide("s", 600, required=True))
        # two compiles at nice 19 (the job's, then the core's): on a host whose cores other
        # work keeps busy they get ~1.5 % of a core each (a loaded CI run passed 300 s here)
        wait_until(lambda: g.ready, "compile", timeout=540.0)
    finally:
        manager.serialize_cpu_s = 2.0
    assert g.error is None and len(core_compiles) == 1 and g.compiled_in == os.getpid()
    g.release()
    assert manager.num_compiles == 0
