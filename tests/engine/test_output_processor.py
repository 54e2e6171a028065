"""A finished request's times as the front end computes them: queue and prefill time from the
core's first-scheduled stamp, none of either when the front end finished the request itself (a
client gone) and never heard that stamp."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sloserve.engine.output_processor import OutputProcessor


def _state(first_token_time):
    req = SimpleNamespace(arrival_time=10.0, prompt_token_ids=[1, 2, 3])
    return SimpleNamespace(request=req, first_token_time=first_token_time, output_token_ids=[5, 6, 7])


def test_times_from_the_cores_first_scheduled_stamp():
    f = OutputProcessor._finished_stats(_state(10.5), "stop", 12.0, 10.2)
    assert f.queue_time == pytest.approx(0.2) and f.prefill_time == pytest.approx(0.3)
    assert f.ttft == pytest.approx(0.5) and f.e2e_latency == pytest.approx(2.0)
    assert f.decode_time == pytest.approx(1.5) and f.tpot == pytest.approx(0.75)


@pytest.mark.parametrize("first_token", [10.5, None])
def test_a_front_end_abort_has_no_queue_or_prefill_time(first_token):
    """(It took the abort's own time for the scheduling: a prefill time of -1.5 s here, a
    negative sum in /metrics.)"""
    f = OutputProcessor._finished_stats(_state(first_token), "abort", 12.0, None)
    assert f.queue_time is None and f.prefill_time is None
    assert f.e2e_latency == pytest.approx(2.0)
    assert (f.ttft is None) == (first_token is None)
