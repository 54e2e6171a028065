"""Where a 1P + 1D run's decode-step tail comes from, from the two instances' step traces
(``sloserve serve --step-trace``; CLOCK_MONOTONIC, one clock for both on one host).

Two questions, each answered from the decode instance's (D's) single-request steps of short
requests (context below ``--long-context``):

* **warm-up after idle**: D's step time by the time since D last came out of an idle spell
  (no step for ``--idle-gap-s``), in 10 ms bins. A step that reads weights the cache no longer
  holds is slow whatever else happens.
* **arriving KV**: the same steps while a long prompt's KV streams in (P's prefill steps of at
  least ``--long-chunk`` tokens, plus ``--tail-s`` after; layer-wise push sends while P
  computes) against all others, both without the first ``--warm-s`` after an idle spell. If
  arriving KV stalled decode steps, the first group would be slower.

Usage: ``python benchmarks/pd_itl_tail.py --decode-trace D.jsonl --prefill-trace P.jsonl``
(benchmarks/pd.sh runs it on its 1P + 1D traces).
"""
from __future__ import annotations

import argparse
import json
import sys


def _load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def _row(v: list[float]) -> str:
    if not v:
        return "n=0"
    return (f"n={len(v)} P50 {_pct(v, 0.5) * 1e3:.2f} / P90 {_pct(v, 0.9) * 1e3:.2f} / "
            f"P99 {_pct(v, 0.99) * 1e3:.2f} ms")


def analyse(d_steps: list[dict], p_steps: list[dict], a) -> dict:
    # P's steps prefilling a long prompt (a step's chunks are [tokens, start] pairs, in the
    # order of its prefill_ids): the prompt's chunks add up to at least --long-chunk tokens
    total: dict[str, int] = {}
    for s in p_steps:
        for rid, (n, _start) in zip(s.get("prefill_ids") or [], s.get("prefill_chunks") or []):
            total[rid] = total.get(rid, 0) + n
    windows = [(s["t"], s["t"] + s["step_s"] + a.tail_s) for s in p_steps
               if any(total[rid] >= a.long_chunk for rid in s.get("prefill_ids") or [])]
    since: dict[int, list[float]] = {}
    during, other = [], []
    prev_end, idle_end = None, None
    for s in d_steps:
        if prev_end is not None and s["t"] - prev_end > a.idle_gap_s:
            idle_end = s["t"]
        prev_end = s["t"] + s["step_s"]
        ctx = s["decode_contexts"]
        if idle_end is None or len(ctx) != 1 or ctx[0] >= a.long_context or s["prefill_chunks"]:
            continue
        dt = s["t"] - idle_end
        since.setdefault(min(int(dt / 0.01), 15), []).append(s["step_s"])
        if dt < a.warm_s:
            continue
        (during if any(lo <= s["t"] <= hi for lo, hi in windows) else other).append(s["step_s"])
    return {"since_idle": since, "during_kv": during, "other": other, "windows": len(windows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-trace", required=True)
    ap.add_argument("--prefill-trace", required=True)
    ap.add_argument("--long-context", type=int, default=1024,
                    help="a decode context at least this long is a long request's (default 1024)")
    ap.add_argument("--long-chunk", type=int, default=1024,
                    help="a prompt of at least this many tokens is long: P's steps prefilling it stream "
                         "its KV (default 1024)")
    ap.add_argument("--tail-s", type=float, default=0.1,
                    help="how long after such a step its KV may still be arriving (s)")
    ap.add_argument("--idle-gap-s", type=float, default=0.05)
    ap.add_argument("--warm-s", type=float, default=0.05,
                    help="steps this soon after an idle spell are left out of the KV comparison")
    a = ap.parse_args(argv)
    r = analyse(_load(a.decode_trace), _load(a.prefill_trace), a)
    print("D's single short-request decode steps by time since D left an idle spell:")
    for k, v in sorted(r["since_idle"].items()):
        label = f">= {k * 10} ms" if k == 15 else f"{k * 10}-{k * 10 + 10} ms"
        print(f"  {label:>10}: {_row(v)}")
    print(f"the same, {a.warm_s * 1e3:.0f} ms or more after an idle spell:")
    print(f"  while a long prompt's KV arrives ({r['windows']} of P's steps): "
          f"{_row(r['during_kv'])}")
    print(f"  otherwise: {_row(r['other'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
