"""The API process's structured-output check runs in a child process (sloserve.server.spec_check):
its verdicts are validate()'s, and a child that dies is replaced without failing the request."""
from __future__ import annotations

import os
import signal

import pytest

from sloserve.engine import structured_output
from sloserve.sampling_params import StructuredOutputsParams
from sloserve.server.spec_check import SpecChecker

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def checker():
    c = SpecChecker()
    yield c
    c.close()


def test_verdicts_are_validates(checker):
    good = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert checker.check(good) is None
    bad = StructuredOutputsParams(regex="((")
    with pytest.raises(ValueError) as in_process:
        structured_output.validate(bad)
    with pytest.raises(ValueError) as in_child:
        checker.check(bad)
    assert str(in_child.value) == str(in_process.value)


def test_a_dead_child_is_replaced(checker):
    spec = StructuredOutputsParams(regex="[0-9]+")
    checker.check(spec)
    (pid,) = list(checker._pool._processes)  # the one child
    os.kill(pid, signal.SIGKILL)
    assert checker.check(spec) is None  # a fresh child answers
    assert pid not in checker._pool._processes


def test_closed_checker_refuses():
    c = SpecChecker()
    c.close()
    with pytest.raises(RuntimeError):
        c.check(StructuredOutputsParams(regex="a"))


def test_the_child_ends_with_its_parent():
    """A process that dies with its checker open (killed, or an app never shut down) leaves
    no checking process behind."""
    import subprocess
    import sys
    import time
    code = ("import os; from sloserve.server.spec_check import SpecChecker; "
            "from sloserve.sampling_params import StructuredOutputsParams as P; "
            "c = SpecChecker(); c.check(P(regex='a')); "
            "print(*c._pool._processes, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    (child,) = map(int, out.stdout.split())
    deadline = time.monotonic() + 60  # a hang guard: the watch polls every 0.5 s
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"checker child {child} outlived its parent"
        time.sleep(0.2)
