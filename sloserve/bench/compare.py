"""``sloserve compare A.json B.json``: two result files (measured or simulated) side by side,
with B's relative difference from A for the headline metrics."""
from __future__ import annotations

import argparse
import json
import sys

KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
        "output_throughput", "request_throughput", "completed", "failed")


def compare(a: dict, b: dict) -> list[tuple[str, float | None, float | None, float | None]]:
    """(key, A, B, (B - A) / A) for every headline key present in either file."""
    rows = []
    for k in KEYS:
        va, vb = a.get(k), b.get(k)
        if va is None and vb is None:
            continue
        rel = (vb - va) / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) \
            and va else None
        rows.append((k, va, vb, rel))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point; 2 for unreadable files."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="sloserve compare", description=__doc__)
    ap.add_argument("a", help="reference result JSON (e.g. measured)")
    ap.add_argument("b", help="result JSON to compare (e.g. simulated)")
    args = ap.parse_args(argv)
    try:
        a, b = (json.load(open(p, encoding="utf-8")) for p in (args.a, args.b))
    except (OSError, ValueError) as e:
        print(f"sloserve compare: error: {e}", file=sys.stderr)
        return 2
    lines = [f"| metric | A: {args.a} ({a.get('label') or '-'}) | B: {args.b} "
             f"({b.get('label') or '-'}) | B vs A |", "|---|---|---|---|"]
    for k, va, vb, rel in compare(a, b):
        fa = "-" if va is None else f"{va:.2f}"
        fb = "-" if vb is None else f"{vb:.2f}"
        lines.append(f"| {k} | {fa} | {fb} | {'-' if rel is None else f'{100 * rel:+.1f} %'} |")
    try:
        print("\n".join(lines))
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stderr.close()
    return 0
