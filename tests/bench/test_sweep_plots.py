"""Sweep: SLO check, operating point, Pareto frontier, table; plots write real PNGs."""
from __future__ import annotations

import pytest

from sloserve.bench.plots import per_request_ms, plot_cdfs, plot_itl_timeline, plot_pareto
from sloserve.bench.results import result_json
from sloserve.bench.sweep import PARETO_KEYS, format_table, meets_slo, operating_point, pareto_front

from .test_results import make_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(point, thr, tpot, ttft, failed=0, e2el=1000.0, goodput=None):
    return {"point": point, "output_throughput": thr, "p99_tpot_ms": tpot, "p99_ttft_ms": ttft,
            "p99_e2el_ms": e2el, "failed": failed, "request_throughput": thr / 10,
            "mean_ttft_ms": ttft / 2, "median_tpot_ms": tpot / 2, "p99_itl_ms": tpot,
            "request_goodput": goodput}


ROWS = [
    row(1, 100.0, 10.0, 100.0),
    row(2, 180.0, 15.0, 150.0),
    row(4, 170.0, 20.0, 400.0),     # dominated by 2 (slower and less throughput)
    row(8, 250.0, 40.0, 2000.0),
    row(16, 240.0, 80.0, 9000.0, failed=3),
]


def test_meets_slo():
    r = ROWS[2]
    assert meets_slo(r, {"tpot": 20.0})               # equal is within
    assert not meets_slo(r, {"tpot": 19.99})
    assert meets_slo(r, {"tpot": 20.0, "ttft": 400.0})
    assert not meets_slo(r, {"tpot": 20.0, "ttft": 399.0})
    assert not meets_slo(r, {"e2el": 999.0})
    assert meets_slo(r, {})


def test_operating_point():
    assert operating_point(ROWS, {"tpot": 50.0}) == 8
    assert operating_point(ROWS, {"tpot": 1000.0, "ttft": 1e5}) == 8   # 16 has failures
    assert operating_point(ROWS, {"tpot": 15.0, "ttft": 150.0}) == 2
    assert operating_point(ROWS, {"tpot": 20.0, "ttft": 120.0}) == 1
    assert operating_point(ROWS, {"tpot": 5.0}) is None
    assert operating_point(ROWS, {}) == 8
    assert operating_point([], {"tpot": 5.0}) is None
    # rates, not list order
    assert operating_point(list(reversed(ROWS)), {"tpot": 50.0}) == 8


def test_pareto_front():
    assert [r["point"] for r in pareto_front(ROWS, "p99_tpot_ms")] == [1, 2, 8]
    assert [r["point"] for r in pareto_front(ROWS, "p99_ttft_ms")] == [1, 2, 8]
    assert [r["point"] for r in pareto_front(list(reversed(ROWS)), "p99_tpot_ms")] == [1, 2, 8]
    # ties: at equal latency only the higher throughput; equal points only once
    rows = [row(1, 100.0, 10.0, 1.0), row(2, 120.0, 10.0, 1.0), row(3, 120.0, 10.0, 1.0),
            row(4, 120.0, 12.0, 1.0), row(5, 130.0, 12.0, 1.0)]
    assert [r["point"] for r in pareto_front(rows, "p99_tpot_ms")] == [2, 5]
    assert pareto_front([], "p99_tpot_ms") == []


def test_format_table():
    t = format_table(ROWS[:2], "request_rate", {"tpot": 12.0})
    lines = t.splitlines()
    assert lines[0] == ("| request_rate | request_throughput | output_throughput | mean_ttft_ms | "
                        "p99_ttft_ms | median_tpot_ms | p99_tpot_ms | p99_itl_ms | request_goodput | "
                        "failed | meets SLO |")
    assert lines[1] == "|" + "---|" * 11
    assert lines[2] == "| 1 | 10.00 | 100.00 | 50.00 | 100.00 | 5.00 | 10.00 | 10.00 | - | 0 | yes |"
    assert lines[3] == "| 2 | 18.00 | 180.00 | 75.00 | 150.00 | 7.50 | 15.00 | 15.00 | - | 0 | no |"
    assert len(lines) == 4
    t = format_table([ROWS[4]], "max_concurrency", {})
    assert "meets SLO" not in t and t.splitlines()[0].startswith("| max_concurrency |")
    # failures never meet the SLO
    assert format_table([ROWS[4]], "x", {"tpot": 1e9}).splitlines()[2].endswith("| 3 | no |")


def _png_ok(path):
    with open(path, "rb") as f:
        data = f.read()
    return data[:8] == PNG_MAGIC and len(data) > 2000


@pytest.fixture
def detailed_result():
    return result_json(make_run(), detailed=True)


def test_per_request_ms_matches_record_tpot(detailed_result):
    run = make_run()
    ttft, tpot = per_request_ms(detailed_result)
    ok = [r for r in run.records if r.success]
    assert ttft == pytest.approx([r.ttft * 1e3 for r in ok], abs=1e-9)
    assert tpot == pytest.approx([r.tpot * 1e3 for r in ok], abs=1e-6)  # 25 ms and 100 ms


def test_plots_write_png(tmp_path, detailed_result):
    p = plot_cdfs({"a": detailed_result, "b": detailed_result}, str(tmp_path / "x" / "cdf.png"), title="t")
    assert p == str(tmp_path / "x" / "cdf.png") and _png_ok(p)
    p = plot_itl_timeline({"a": detailed_result, "b": detailed_result}, str(tmp_path / "itl.png"))
    assert _png_ok(p)
    fronts = {k: pareto_front(ROWS, k) for k in PARETO_KEYS}
    p = plot_pareto(ROWS, str(tmp_path / "pareto.png"), fronts, operating_point=8, title="sweep")
    assert _png_ok(p)
    p = plot_pareto(ROWS[:1], str(tmp_path / "pareto1.png"),
                    {k: pareto_front(ROWS[:1], k) for k in PARETO_KEYS}, operating_point=None)
    assert _png_ok(p)
