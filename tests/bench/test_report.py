"""``--report FILE.html``: one self-contained page (simulated runs make the results, so no
server is needed): its summary cells hold the result JSON's own values, it references nothing
outside itself, and in headless Chromium with networking off every chart draws."""
from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser

import pytest

from sloserve.bench.report import SUMMARY
from sloserve.sim.cli import main as sim_main
from tests.browser import chromium as browser_chromium

SIM = ["--decode-step-ms", "10", "--prefill-tokens-per-s", "5000", "--dataset-name", "random",
       "--random-input-len", "200", "--random-output-len", "32", "--num-prompts", "40",
       "--goodput", "ttft:500", "tpot:50"]


class _Cells(HTMLParser):
    """The summary rows: label -> [(column index, data-value)], and every src/href seen."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self.refs: list[str] = []
        self._row = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "tr" and "data-label" in a:
            self._row = self.rows.setdefault(a["data-label"], [])
        elif tag == "td" and self._row is not None and "data-value" in a:
            self._row.append(a["data-value"])

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None


def _columns(results: list[dict]) -> list[str]:
    return [k for k, _, _ in SUMMARY if any(k in r for r in results)]


def _check_cells(page: str, results: dict[str, dict]) -> None:
    p = _Cells()
    p.feed(page)
    assert list(p.rows) == list(results)
    cols = _columns(list(results.values()))
    for label, r in results.items():
        want = ["" if r.get(k) is None else json.dumps(r[k]) for k in cols]
        assert p.rows[label] == want, label
    # nothing outside the page: no src/href, no url(...) in styles, no script
    assert p.refs == [] and "<script" not in page
    assert not re.search(r"url\((?!#)|https?://(?!www\.w3\.org/)", page)  # only in-page refs


def _open_offline(path: str) -> list[int]:
    """Paths drawn in each chart, in Chromium with networking off (skips without it)."""
    sync_playwright, chromium = browser_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_context(offline=True).new_page()
            page.goto("file://" + os.path.abspath(path))
            return page.evaluate("""[...document.querySelectorAll('figure.chart svg')].map(
                s => s.getBoundingClientRect().width > 100 ?
                     s.querySelectorAll('path, use').length : 0)""")
        finally:
            browser.close()


def test_a_run_report_holds_the_results_numbers_and_draws_offline(tmp_path):
    html_path, res_path = tmp_path / "r.html", tmp_path / "r.json"
    assert sim_main([*SIM, "--request-rate", "5", "--label", "run",
                     "--save-result", str(res_path), "--report", str(html_path)]) == 0
    res = json.loads(res_path.read_text())
    page = html_path.read_text()
    _check_cells(page, {"run": res})
    assert "sloserve sim" in page and "--report" in page and "<dt>cpu</dt>" in page
    drawn = _open_offline(str(html_path))
    assert len(drawn) == 2 and all(n > 10 for n in drawn), drawn  # CDFs, ITL timeline


def test_a_sweep_report_has_every_point_and_the_pareto_plot(tmp_path):
    html_path = tmp_path / "s.html"
    assert sim_main([*SIM, "--request-rates", "2,5,10", "--result-dir", str(tmp_path / "sw"),
                     "--report", str(html_path)]) == 0
    rows = json.loads((tmp_path / "sw" / "sweep.json").read_text())["rows"]
    _check_cells(html_path.read_text(), {f"rate {r['point']:g}": r for r in rows})
    drawn = _open_offline(str(html_path))
    assert len(drawn) == 1 and drawn[0] > 3, drawn


def test_report_flags_are_checked():
    assert sim_main([*SIM, "--find-capacity", "--slo-p99-ttft-ms", "500",
                     "--report", "x.html"]) == 2
