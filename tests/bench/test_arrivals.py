"""Arrival processes: gap mean = 1/rate, gap CV = 1/sqrt(burstiness), seeded, validated."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sloserve.bench.arrivals import ArrivalProcess, arrival_times

N = 40_000


def gap_stats(t: np.ndarray) -> tuple[float, float]:
    g = np.diff(t)
    return float(g.mean()), float(g.std() / g.mean())


@pytest.mark.parametrize("process, burstiness, cv", [
    ("poisson", 1.0, 1.0),
    ("poisson", 0.25, 1.0),   # poisson ignores burstiness
    ("gamma", 1.0, 1.0),
    ("gamma", 0.25, 2.0),
    ("gamma", 4.0, 0.5),
])
def test_mean_and_cv_match_rate_and_burstiness(process, burstiness, cv):
    t = arrival_times(N, 5.0, process=process, burstiness=burstiness, seed=1)
    assert t.shape == (N,) and t.dtype == np.float64
    assert t[0] == 0.0
    assert np.all(np.diff(t) >= 0)
    mean, got_cv = gap_stats(t)
    assert mean == pytest.approx(0.2, rel=0.03)
    assert got_cv == pytest.approx(cv, rel=0.05)


def test_poisson_ignores_burstiness_exactly():
    a = arrival_times(100, 3.0, process="poisson", burstiness=0.25, seed=7)
    b = arrival_times(100, 3.0, process=ArrivalProcess.POISSON, burstiness=1.0, seed=7)
    np.testing.assert_array_equal(a, b)


def test_constant_rate_gaps_are_exact():
    t = arrival_times(11, 4.0, process="constant", burstiness=0.3, seed=5)
    np.testing.assert_allclose(t, np.arange(11) * 0.25, rtol=0, atol=1e-12)
    mean, cv = gap_stats(t)
    assert mean == pytest.approx(0.25, abs=1e-12)
    assert cv == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("process", ["poisson", "gamma", "constant"])
def test_infinite_rate_sends_everything_at_zero(process):
    t = arrival_times(7, math.inf, process=process, burstiness=0.5)
    np.testing.assert_array_equal(t, np.zeros(7))


def test_small_n():
    assert arrival_times(0, 2.0).shape == (0,)
    np.testing.assert_array_equal(arrival_times(1, 2.0), [0.0])


@pytest.mark.parametrize("process", ["poisson", "gamma"])
def test_seeding(process):
    a = arrival_times(50, 2.0, process=process, burstiness=0.5, seed=3)
    b = arrival_times(50, 2.0, process=process, burstiness=0.5, seed=3)
    c = arrival_times(50, 2.0, process=process, burstiness=0.5, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.all(a[1:] != c[1:])


@pytest.mark.parametrize("kwargs", [
    dict(n=-1, request_rate=1.0),
    dict(n=5, request_rate=0.0),
    dict(n=5, request_rate=-2.0),
    dict(n=5, request_rate=float("nan")),
    dict(n=5, request_rate=1.0, burstiness=0.0),
    dict(n=5, request_rate=1.0, burstiness=-1.0),
    dict(n=5, request_rate=1.0, burstiness=float("inf")),
    dict(n=5, request_rate=1.0, burstiness=float("nan")),
    dict(n=5, request_rate=1.0, process="uniform"),
])
def test_bad_inputs_raise_value_error(kwargs):
    n = kwargs.pop("n")
    rate = kwargs.pop("request_rate")
    with pytest.raises(ValueError):
        arrival_times(n, rate, **kwargs)
