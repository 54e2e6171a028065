#!/usr/bin/env python3
"""A decode stream beside a slow grammar compile: does the compile take the stream's cores?

HTTP only (httpx): any OpenAI-compatible server with vLLM's ``structured_outputs`` field.
``--rounds`` rounds, each of two phases, so that both see the same host (a shared machine's
load drifts): quiet, ``--streams`` greedy streams of ``--max-tokens`` tokens one after the
other; then compiling: a streamed request with a wide JSON schema (``--properties`` optional
integer properties, a new property prefix each round so that no server cache hides the
compile) is sent, and once the server reports the compile running (sloserve's
``sloserve:grammar_compiles`` gauge; a server without it: after ``--lead-s`` seconds) the same
streams run; then the schema's request is cancelled (its connection closed) and, on a server
with the gauge, the next round waits until the compile is gone.

Before the rounds, one stream and one request with a small grammar warm the server up (the
first structured request of a server loads xgrammar into its processes: a one-time cost, not
the compile's). Reported per condition, over every round: the inter-token latencies (ITL, the gaps between a
stream's token events) at P50 / P99 / max and the streams' mean duration, and the P99 ratio
compiling / quiet (issue 33's bar: within 2x). Start the server with the compile limit off, so
that the compile runs through each compiling phase:

    .venv/bin/sloserve serve --port 8311 --structured-outputs-compile-timeout 0 &
    .venv/bin/python benchmarks/grammar_interference.py --url http://127.0.0.1:8311 \\
        --json /tmp/grammar_interference.json

Exit status 1 when a compile was not running through its phase (that round is void).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import httpx

_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def wide_schema(prefix: str, n: int) -> dict:
    return {"type": "object",
            "properties": {f"{prefix}{i:04d}": {"type": "integer"} for i in range(n)}}


def compiles(c: httpx.Client) -> int | None:
    """The server's ``sloserve:grammar_compiles`` gauge (None: it has none)."""
    m = re.search(r"^sloserve:grammar_compiles\{[^}]*\} ([0-9.e+]+)$", c.get("/metrics").text,
                  re.M)
    return None if m is None else int(float(m.group(1)))


def stream_itls(c: httpx.Client, model: str, max_tokens: int) -> tuple[list[float], float]:
    """One greedy stream: the gaps between its token events (s) and its duration (s)."""
    body = {"model": model, "prompt": "The history of the city begins", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if any(ch.get("text") for ch in json.loads(line[6:]).get("choices", ())):
                    stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])], time.perf_counter() - t0


def run_streams(c: httpx.Client, model: str, streams: int, max_tokens: int,
                into: dict) -> None:
    for _ in range(streams):
        gaps, dur = stream_itls(c, model, max_tokens)
        into["itls"] += gaps
        into["durations"].append(dur)


def summary(d: dict) -> dict:
    itls = d["itls"]
    q = statistics.quantiles(itls, n=100, method="inclusive")
    return {"itl_p50_ms": q[49] * 1e3, "itl_p99_ms": q[98] * 1e3, "itl_max_ms": max(itls) * 1e3,
            "stream_mean_s": statistics.fmean(d["durations"]), "num_itls": len(itls)}


def wait_gauge(c: httpx.Client, ok, what: str, limit_s: float = 300) -> bool:
    t0 = time.monotonic()
    while not ok(compiles(c)):
        if time.monotonic() - t0 > limit_s:
            print(f"{what}: not after {limit_s:.0f} s", file=sys.stderr)
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8311")
    p.add_argument("--rounds", type=int, default=3, help="quiet / compiling rounds")
    p.add_argument("--streams", type=int, default=3, help="greedy streams per phase")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per stream")
    p.add_argument("--properties", type=int, default=2000, help="properties of the wide schema")
    p.add_argument("--lead-s", type=float, default=2.0,
                   help="without the compile gauge: seconds between sending the schema and "
                        "the compiling phase")
    p.add_argument("--json", default=None, help="write the report here too")
    a = p.parse_args(argv)
    quiet = {"itls": [], "durations": []}
    during = {"itls": [], "durations": []}
    void = []
    with httpx.Client(base_url=a.url, timeout=600) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        gauge = compiles(c) is not None
        stream_itls(c, model, 4)  # warm-up
        # and one small grammar: the first structured request loads xgrammar into the API
        # process and the engine core and starts sloserve's compile worker, once per server
        r = c.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2,
                                            "structured_outputs": {"choice": ["a", "b"]}})
        r.raise_for_status()
        per_round = []
        for r in range(a.rounds):
            q0, d0 = len(quiet["itls"]), len(during["itls"])
            run_streams(c, model, a.streams, a.max_tokens, quiet)
            # a new prefix each round, short enough that the schema stays under the server's
            # 65,536-character limit on a spec
            n = (int(time.time() * 10) + r) % 36 ** 2
            schema = wide_schema("x" + _B36[n // 36] + _B36[n % 36], a.properties)
            req = c.build_request("POST", "/v1/completions", json={
                "model": model, "prompt": "x", "max_tokens": 4, "stream": True,
                "structured_outputs": {"json": schema}})
            resp = c.send(req, stream=True)
            try:
                if gauge:
                    if not wait_gauge(c, lambda v: v >= 1, "the compile never showed up"):
                        return 1
                else:
                    time.sleep(a.lead_s)
                run_streams(c, model, a.streams, a.max_tokens, during)
                if gauge and compiles(c) < 1:
                    void.append(r)
            finally:
                resp.close()  # the client is gone: the server drops the compile
            if gauge and not wait_gauge(c, lambda v: v == 0, "the compile was not stopped"):
                return 1
            per_round.append({name: round(max(d["itls"][i:]) * 1e3, 1)
                              for name, d, i in (("quiet_max_itl_ms", quiet, q0),
                                                 ("compiling_max_itl_ms", during, d0))})
            print(f"round {r + 1}: max ITL quiet {per_round[-1]['quiet_max_itl_ms']} ms, "
                  f"compiling {per_round[-1]['compiling_max_itl_ms']} ms", flush=True)
    report = {"url": a.url, "rounds": a.rounds, "streams": a.streams,
              "max_tokens": a.max_tokens, "properties": a.properties,
              "quiet": summary(quiet), "compiling": summary(during), "void_rounds": void,
              "rounds_detail": per_round}
    report["p99_ratio"] = report["compiling"]["itl_p99_ms"] / report["quiet"]["itl_p99_ms"]
    for name in ("quiet", "compiling"):
        s = report[name]
        print(f"{name + ':':11s}ITL P50 {s['itl_p50_ms']:.1f} ms, P99 {s['itl_p99_ms']:.1f} ms, "
              f"max {s['itl_max_ms']:.1f} ms, stream {s['stream_mean_s']:.2f} s "
              f"({s['num_itls']} ITLs)")
    print(f"P99 ITL compiling / quiet: {report['p99_ratio']:.2f}x"
          + (f"; rounds whose compile ended early (void): {void}" if void else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if void else 0


if __name__ == "__main__":
    sys.exit(main())
