"""calculate_metrics on hand-built records: exact statistics (numpy linear percentiles, population
std), TPOT only for > 1 output token, failures excluded, concurrency, peak rate, goodput."""
from __future__ import annotations

import math

import pytest

from sloserve.bench.metrics import DEFAULT_PERCENTILES, METRICS, Stats, calculate_metrics, is_good
from sloserve.slo import missed_slo, parse_goodput
from sloserve.workload import RequestRecord


def rec(send, ttft, itl, out, prompt_len, *, latency=None, success=True, error="", chunk_times=None):
    """A successful record with explicitly given fields (no float round trips through chunk times
    unless given)."""
    if latency is None:
        latency = ttft + sum(itl)
    if chunk_times is None:
        chunk_times = [send + ttft]
        for g in itl:
            chunk_times.append(chunk_times[-1] + g)
    return RequestRecord(success=success, error=error, prompt_len=prompt_len, output_tokens=out,
                         send_time=send, ttft=ttft, itl=list(itl), latency=latency,
                         chunk_times=chunk_times if success or chunk_times else [])


def failed(send, prompt_len, error):
    return RequestRecord(success=False, error=error, prompt_len=prompt_len, send_time=send)


@pytest.fixture
def records():
    return [
        rec(0.00, 0.100, [0.020, 0.030], 3, 10, latency=0.150),         # tpot 25 ms
        rec(0.05, 0.300, [0.010] * 4, 5, 20, latency=0.340),            # tpot 10 ms
        rec(0.10, 0.200, [], 1, 30, latency=0.200),                     # 1 token: no tpot
        failed(0.20, 40, "HTTP 500: boom"),
        rec(0.50, 0.050, [0.050], 2, 7, latency=0.100),                 # tpot 50 ms
        failed(0.60, 50, "HTTP 500: boom"),
        failed(0.70, 60, "ReadTimeout"),
    ]


def test_counts_and_throughputs_exclude_failures(records):
    m = calculate_metrics(records, duration=2.0)
    assert (m.completed, m.failed) == (4, 3)
    assert m.total_input == 67 and m.total_output == 11
    assert m.request_throughput == 2.0
    assert m.output_throughput == 5.5
    assert m.total_token_throughput == 39.0
    assert m.duration == 2.0
    assert m.errors == {"HTTP 500: boom": 2, "ReadTimeout": 1}
    assert m.request_goodput is None and m.num_good == 0 and m.goodput_slos == {}


def test_exact_statistics(records):
    m = calculate_metrics(records, duration=1.0)
    ttft, tpot, itl, e2el = (m.stats[k] for k in ("ttft", "tpot", "itl", "e2el"))
    # TTFT ms: 100, 300, 200, 50
    assert ttft.count == 4
    assert ttft.mean == pytest.approx(162.5, abs=1e-9)
    assert ttft.median == pytest.approx(150.0, abs=1e-9)
    assert ttft.std == pytest.approx(math.sqrt(9218.75), abs=1e-9)  # population std
    assert ttft.p(50) == pytest.approx(150.0, abs=1e-9)
    assert ttft.p(90) == pytest.approx(270.0, abs=1e-9)
    assert ttft.p(95) == pytest.approx(285.0, abs=1e-9)
    assert ttft.p(99) == pytest.approx(297.0, abs=1e-9)
    assert ttft.max == pytest.approx(300.0, abs=1e-9)
    # TPOT ms: 25, 10, 50 (the 1-token request has none)
    assert tpot.count == 3
    assert tpot.mean == pytest.approx(85 / 3, abs=1e-9)
    assert tpot.median == pytest.approx(25.0, abs=1e-9)
    assert tpot.p(99) == pytest.approx(49.5, abs=1e-9)
    # ITL ms pooled: 20, 30, 10, 10, 10, 10, 50
    assert itl.count == 7
    assert itl.mean == pytest.approx(20.0, abs=1e-9)
    assert itl.median == pytest.approx(10.0, abs=1e-9)
    assert itl.p(99) == pytest.approx(48.8, abs=1e-9)
    # E2E ms: 150, 340, 200, 100
    assert e2el.count == 4
    assert e2el.mean == pytest.approx(197.5, abs=1e-9)
    assert e2el.median == pytest.approx(175.0, abs=1e-9)
    assert e2el.p(99) == pytest.approx(335.8, abs=1e-9)
    assert [p for p, _ in ttft.percentiles] == list(DEFAULT_PERCENTILES)


def test_custom_percentiles_and_missing_percentile(records):
    m = calculate_metrics(records, duration=1.0, percentiles=(0, 25, 100))
    s = m.stats["ttft"]
    assert [p for p, _ in s.percentiles] == [0, 25, 100]
    assert s.p(0) == pytest.approx(50.0, abs=1e-9)
    assert s.p(25) == pytest.approx(87.5, abs=1e-9)
    assert s.p(100) == pytest.approx(300.0, abs=1e-9)
    with pytest.raises(KeyError):
        s.p(99)


def test_tpot_undefined_for_one_token_and_failed():
    assert rec(0.0, 0.1, [], 1, 1).tpot is None
    assert rec(0.0, 0.1, [], 0, 1).tpot is None
    r = rec(0.0, 0.1, [0.02, 0.03], 3, 1, latency=0.15)
    assert r.tpot == pytest.approx(0.025, abs=1e-15)
    r.success = False
    assert r.tpot is None
    m = calculate_metrics([rec(0.0, 0.1, [], 1, 1)], duration=1.0)
    assert m.stats["tpot"].count == 0 and m.stats["tpot"].mean == 0.0


def test_all_failed_gives_zero_statistics():
    m = calculate_metrics([failed(0.0, 3, "x"), failed(0.1, 4, "y")], duration=0.5,
                          goodput_slos={"ttft": 100.0})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (0, 2, 0, 0)
    assert m.request_throughput == 0.0 and m.request_goodput == 0.0 and m.num_good == 0
    for k in METRICS:
        s = m.stats[k]
        assert (s.mean, s.median, s.std, s.count, s.max) == (0.0, 0.0, 0.0, 0, 0.0)
        assert s.percentiles == [(p, 0.0) for p in DEFAULT_PERCENTILES]
    assert Stats.of([], [50.0]).percentiles == [(50.0, 0.0)]


def test_goodput_in_metrics(records):
    m = calculate_metrics(records, duration=2.0, goodput_slos={"ttft": 250.0, "tpot": 30.0})
    # good: #0 (ttft 100, tpot 25) and #2 (ttft 200, tpot undefined); not #1 (ttft 300), #4 (tpot 50)
    assert m.num_good == 2 and m.request_goodput == 1.0
    assert [is_good(r, {"ttft": 250.0, "tpot": 30.0}) for r in records] == [
        True, False, True, False, False, False, False]
    m = calculate_metrics(records, duration=2.0, goodput_slos={"e2el": 160.0})
    assert m.num_good == 2  # e2el 150 and 100
    # a limit is met when equal
    m = calculate_metrics(records, duration=1.0, goodput_slos={"ttft": 100.0})
    assert m.num_good == 2  # ttft 100 and 50


def test_max_concurrent_requests_counts_whole_seconds():
    """vLLM's definition: a request counts in every 1-s bucket (from the run's start) from its
    send to its last chunk; the peak is the fullest bucket."""
    # [0, 0.4] and [0.5, 0.9] never overlap but share second 0
    rs = [rec(0.0, 0.2, [0.2], 2, 1), rec(0.5, 0.2, [0.2], 2, 1)]
    assert calculate_metrics(rs, 1.0).max_concurrent_requests == 2
    # [0, 1.0] spans seconds 0 and 1; [1.2, 1.5] and [2.5, 3.5] -> buckets {0:1, 1:2, 2:1, 3:1}
    rs = [rec(0.0, 0.5, [0.5], 2, 1), rec(1.2, 0.1, [0.2], 2, 1), rec(2.5, 0.5, [0.5], 2, 1)]
    assert calculate_metrics(rs, 4.0).max_concurrent_requests == 2
    # buckets count from start_time, not from the first send
    rs = [rec(0.9, 0.05, [], 1, 1), rec(1.05, 0.05, [], 1, 1)]
    assert calculate_metrics(rs, 2.0).max_concurrent_requests == 2            # start = 0.9
    assert calculate_metrics(rs, 2.0, start_time=0.0).max_concurrent_requests == 1
    # failed requests count too (at least in the second they were sent)
    rs = [rec(0.0, 0.1, [], 1, 1), failed(0.5, 1, "x"), failed(2.5, 1, "y")]
    assert calculate_metrics(rs, 3.0, start_time=0.0).max_concurrent_requests == 2


def test_peak_output_tokens_per_second_counts_whole_seconds():
    r = rec(0.0, 0.0, [], 5, 1, chunk_times=[0.0, 0.5, 0.99, 1.0, 1.5])
    assert calculate_metrics([r], 2.0, start_time=0.0).max_output_tokens_per_s == 3.0
    # 4 chunks within 0.4 s, but split 1 + 3 over seconds 0 and 1
    r = rec(0.0, 0.0, [], 4, 1, chunk_times=[0.9, 1.1, 1.2, 1.3])
    assert calculate_metrics([r], 2.0, start_time=0.0).max_output_tokens_per_s == 3.0
    # failed requests' chunks are excluded
    r = rec(0.0, 0.0, [], 4, 1, chunk_times=[0.0, 0.25, 0.5, 0.75])
    f = rec(0.0, 0.0, [], 4, 1, chunk_times=[0.1, 0.2, 0.3], success=False, error="x")
    assert calculate_metrics([r, f], 2.0, start_time=0.0).max_output_tokens_per_s == 4.0
    assert calculate_metrics([f], 2.0, start_time=0.0).max_output_tokens_per_s == 0.0


def test_fixture_peaks(records):
    m = calculate_metrics(records, 2.0)
    assert m.max_output_tokens_per_s == 11.0   # every chunk of the good requests in second 0
    assert m.max_concurrent_requests == 7      # all seven sent (and ended) within second 0


@pytest.mark.parametrize("duration", [0.0, -1.0, float("nan")])
def test_bad_duration(duration):
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics([], duration)


@pytest.mark.parametrize("p", [-1.0, 100.5])
def test_bad_percentile(p):
    with pytest.raises(ValueError, match="percentiles"):
        calculate_metrics([], 1.0, percentiles=(50.0, p))


def test_missed_slo_names_the_first_limit_missed():
    slos = {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert missed_slo(slos, 0.5, 0.05, 2.0) is None  # at the limits: met
    assert missed_slo(slos, 0.6, 0.06, 3.0) == "ttft"  # all three missed: attributed to ttft
    assert missed_slo(slos, 0.1, 0.051, 3.0) == "tpot"
    assert missed_slo(slos, 0.1, None, 2.5) == "e2el"  # one output token: no TPOT, meets it
    assert missed_slo({"tpot": 50.0}, 9.0, 0.01, 99.0) is None  # only the limits given count


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0,
                                                                 "e2el": 10000.0}
    assert parse_goodput([]) == {}
    assert parse_goodput(["ttft:1", "ttft:2"]) == {"ttft": 2.0}


@pytest.mark.parametrize("item, match", [
    ("foo", "NAME:MS"),
    ("ttft500", "NAME:MS"),
    ("itl:50", "ttft, tpot or e2el"),
    ("TTFT:50", "ttft, tpot or e2el"),
    ("ttft:abc", "number of ms"),
    ("ttft:", "number of ms"),
    ("ttft:0", "> 0"),
    ("tpot:-5", "> 0"),
    ("e2el:inf", "finite"),
    ("e2el:nan", "> 0"),
])
def test_parse_goodput_errors(item, match):
    with pytest.raises(ValueError, match=match):
        parse_goodput([item])
