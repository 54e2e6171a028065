"""The experiment's reading of its own table."""
from __future__ import annotations

from sloserve.bench.experiment import reading


def row(policy, p99_tpot, max_itl=100.0, ttft=500.0):
    return {"policy": policy, "p99_tpot_ms": p99_tpot, "max_itl_ms": max_itl, "mean_ttft_ms": ttft}


def test_reading_reports_the_changes_and_explains_a_tpot_that_did_not_drop():
    lines = reading([row("naive", 156, 1339, 437), row("chunked", 176, 410, 651)])
    assert lines[0] == ("chunked vs naive: max ITL 1339 -> 410 ms (-69 %), P99 TPOT 156 -> 176 ms "
                        "(+13 %), mean TTFT 437 -> 651 ms (+49 %).")
    assert lines[1] == "Chunking cut the longest stall (max ITL) and P99 TPOT rose here."
    assert len(lines) == 3 and "marginal cost of a prefill token" in lines[2]
    assert "does not fall" in lines[2] and "stays" not in lines[2]


def test_reading_says_tpot_did_not_cut_when_it_held_and_flags_a_rise_over_20_percent():
    """A loaded host's run read "did not cut P99 TPOT ... stays" over a 1327 -> 1752 ms rise
    (a new user's report): a rise is called one, and over 20 % the reading points at the load."""
    held = reading([row("naive", 100, 800), row("chunked", 103, 30)])
    assert held[1] == "Chunking cut the longest stall (max ITL) and did not cut P99 TPOT here."
    assert len(held) == 3
    risen = reading([row("naive", 1327, 9000), row("chunked", 1752, 4000)])
    assert risen[1] == "Chunking cut the longest stall (max ITL) and P99 TPOT rose here."
    assert risen[3].startswith("A rise of more than 20 %") and len(risen) == 4


def test_the_reading_never_claims_a_stall_cut_the_table_does_not_show():
    """A noisy run where chunking made max ITL worse (9426 -> 16340 ms) must not read as
    'chunking removed the long stalls'."""
    lines = reading([row("naive", 156, 9426), row("chunked", 170, 16340)])
    assert "max ITL 9426 -> 16340 ms (+73 %)" in lines[0]
    assert lines[1] == ("Chunking did not cut the longest stall (max ITL) and P99 TPOT rose "
                        "here.")


def test_no_explanation_when_chunking_cuts_p99_tpot():
    lines = reading([row("naive", 200), row("chunked", 150), row("static", 120, ttft=5000)])
    assert len(lines) == 3 and "P99 TPOT 200 -> 150 ms (-25 %)" in lines[0]
    assert lines[1] == "Chunking did not cut the longest stall (max ITL) and cut P99 TPOT here."
    assert lines[2] == ("static: P99 TPOT 120 ms (the lowest: no prefill joins a running batch), "
                        "but mean TTFT 5000 ms: new requests wait for the whole batch to finish.")


def test_static_is_not_called_lowest_when_it_is_not():
    lines = reading([row("naive", 140), row("chunked", 183), row("static", 151, ttft=5580)])
    assert lines[-1].startswith("static: P99 TPOT 151 ms, but mean TTFT 5580 ms")


def test_static_is_not_said_to_cost_ttft_when_its_ttft_was_the_lowest():
    lines = reading([row("naive", 662, ttft=3377), row("chunked", 869, ttft=7660),
                     row("static", 46, ttft=557)])
    assert lines[-1] == ("static: P99 TPOT 46 ms (the lowest: no prefill joins a running batch), "
                         "and mean TTFT 557 ms, the lowest here too.")


def test_nothing_to_read_without_both_policies():
    assert reading([row("static", 100)]) == []


def _table_row(policy, good, n=40):
    return {"policy": policy, "mean_ttft_ms": 100.0, "p99_ttft_ms": 900.0, "p50_tpot_ms": 5.0,
            "p90_tpot_ms": 9.0, "p99_tpot_ms": 19.0, "max_itl_ms": 115.0,
            "output_throughput": 42.0, "request_goodput": 0.7, "good": good, "requests": n}


def test_the_table_says_why_throughput_is_equal_only_when_every_request_met_the_slo():
    """A newcomer saw 42.0 tok/s and 0.70 req/s for all three policies and wondered why: when
    all requests are good, both are the offered load's (a fresh user's report)."""
    from sloserve.bench.experiment import ExperimentConfig, comparison_table
    cfg = ExperimentConfig()
    all_good = comparison_table([_table_row("naive", 40), _table_row("chunked", 40)], cfg)
    assert "offered load" in all_good.caption
    some_bad = comparison_table([_table_row("naive", 31), _table_row("chunked", 40)], cfg)
    assert some_bad.caption is None
