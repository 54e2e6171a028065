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
