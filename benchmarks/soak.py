#!/usr/bin/env python3
"""Overload soak: offer ~1.5x a server's capacity for a while and check that it holds.

HTTP only (httpx + asyncio; no engine or model code): any OpenAI-compatible server that exposes
vLLM's ``/metrics`` gauges can be soaked; the server's process (and its engine-core child, found
in /proc) must run on this machine for the memory check.

Phases: (1) capacity, measured with a closed loop of streamed requests (or given with
``--capacity``); (2) warm-up at the overload rate; drain, RSS at start; (3) the soak at the
overload rate (Poisson arrivals, mixed prompt lengths, completions and chat, streamed) for
``--duration`` seconds or ``--num-requests`` requests; drain, RSS at end. ``/health`` is polled
every 0.2 s throughout (from its own thread; the report counts the polls answered in each phase),
which also samples both RSS every 5 s (in the JSON report, to tell a plateau from steady growth).

Checks (exit status 1 when one fails, 2 for a usage error):
  * no 5xx, no other unexpected status, no transport error, no error event in a 200 stream;
  * every ``/health`` answers 200 in under 1 s (``--health-limit-s``; a poll that gets no answer
    within ``--health-timeout`` s counts as failed);
  * RSS of the server process and of the engine core grows by less than 5 % from start (after
    the warm-up) to end;
  * after the soak drained: ``vllm:num_requests_running`` = ``vllm:num_requests_waiting`` = 0 and
    ``vllm:kv_cache_usage_perc`` = 0 (no KV block left referenced; blocks only the prefix cache
    keeps count as free).

    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid PID --duration 240 \\
        --json benchmarks/results/soak/soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass

import httpx

#: one BPE token each in SmolLM2's (and GPT-2-style) vocabularies, with their leading space
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money story "
         "fact month lot right study book eye job word business issue side kind head house "
         "service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office "
         "door health person art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()


# ------------------------------------------------------------------------------ the server's side
def rss_kb(pid: int) -> int:
    """VmRSS of a process (kB) from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    if m is None:
        raise RuntimeError(f"no VmRSS for pid {pid}")
    return int(m.group(1))


def find_core_pid(server_pid: int) -> int | None:
    """The server's engine-core child: a child process whose command line names
    ``sloserve.engine.core_proc``, else its only child; None if there is none."""
    children = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != server_pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        children.append((int(d), cmd))
    for pid, cmd in children:
        if "sloserve.engine.core_proc" in cmd:
            return pid
    return children[0][0] if len(children) == 1 else None


def gauges(text: str) -> dict[str, float]:
    """vllm:num_requests_running / _waiting and vllm:kv_cache_usage_perc from /metrics text."""
    out = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else math.nan
    return out


class HealthPoller(threading.Thread):
    """GET /health every ``interval`` s on its own thread and connection: latency of each; and
    every ``rss_every`` s the RSS of ``pids`` ([seconds since start, kB, ...] in rss_samples)."""

    def __init__(self, url: str, interval: float = 0.2, timeout: float = 5.0,
                 pids: dict[str, int] | None = None, rss_every: float = 5.0):
        super().__init__(name="soak-health", daemon=True)
        self.url, self.interval, self.timeout = url, interval, timeout
        self.pids, self.rss_every = dict(pids or {}), rss_every
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.rss_samples: list[list[float]] = []
        self.t0 = time.perf_counter()
        self._halt = threading.Event()

    def run(self) -> None:
        next_rss = 0.0
        with httpx.Client(timeout=self.timeout) as c:
            while not self._halt.is_set():
                t0 = time.perf_counter()
                if self.pids and t0 - self.t0 >= next_rss:
                    try:
                        self.rss_samples.append([round(t0 - self.t0, 1)]
                                                + [rss_kb(p) for p in self.pids.values()])
                    except (OSError, RuntimeError):
                        pass  # the process is gone: the end-of-run read will say so
                    next_rss += self.rss_every
                    t0 = time.perf_counter()
                try:
                    r = c.get(self.url + "/health")
                    if r.status_code != 200:
                        self.failures.append(f"/health answered {r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(f"/health: {type(e).__name__}: {e}")
                dt = time.perf_counter() - t0
                self.latencies.append(dt)
                self._halt.wait(max(0.0, self.interval - dt))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=self.timeout + 10)  # a poll in flight ends within its timeout


# ---------------------------------------------------------------------------------- the workload
@dataclass
class Result:
    phase: str
    api: str                  # "completions" | "chat"
    prompt_words: int
    max_tokens: int
    status: int = 0           # HTTP status; 0: transport error
    ttft_s: float | None = None
    e2e_s: float = 0.0
    content_events: int = 0
    error: str = ""


def parse_mix(spec: str) -> list[tuple[int, int, float]]:
    """"8-32:0.5,64-160:0.35,200-350:0.15" -> [(8, 32, 0.5), ...] (prompt words, weight)."""
    out = []
    for part in spec.split(","):
        rng, w = part.split(":")
        lo, hi = (int(x) for x in rng.split("-"))
        if not 1 <= lo <= hi or float(w) <= 0:
            raise ValueError(f"bad prompt-mix part {part!r}")
        out.append((lo, hi, float(w)))
    return out


class Workload:
    """Seeded random requests: prompt lengths from the mix (words, one token each), output
    lengths uniform in [min, max] with ignore_eos, a share of them chat."""

    def __init__(self, args, model: str):
        self.rng = random.Random(args.seed)
        self.mix = parse_mix(args.prompt_mix)
        self.out_lo, self.out_hi = (int(x) for x in args.output_tokens.split("-"))
        self.chat_fraction = args.chat_fraction
        self.model = model

    def next(self) -> tuple[str, dict, int, int]:
        rng = self.rng
        lo, hi, _ = rng.choices(self.mix, weights=[w for *_, w in self.mix])[0]
        n = rng.randint(lo, hi)
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        max_tokens = rng.randint(self.out_lo, self.out_hi)
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        if rng.random() < self.chat_fraction:
            body["messages"] = [{"role": "user", "content": text}]
            return "/v1/chat/completions", body, n, max_tokens
        body["prompt"] = text
        return "/v1/completions", body, n, max_tokens


async def send(client: httpx.AsyncClient, phase: str, spec) -> Result:
    path, body, n, max_tokens = spec
    res = Result(phase, "chat" if "chat" in path else "completions", n, max_tokens)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                if r.status_code != 429:
                    res.error = r.text[:200]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        res.error = json.dumps(d["error"])[:200]
                        continue
                    ch = (d.get("choices") or [{}])[0]
                    if ch.get("text") or (ch.get("delta") or {}).get("content"):
                        if res.ttft_s is None:
                            res.ttft_s = time.perf_counter() - t0
                        res.content_events += 1
    except httpx.HTTPError as e:
        res.status, res.error = 0, f"{type(e).__name__}: {e}"
    res.e2e_s = time.perf_counter() - t0
    return res


async def closed_loop(client, work: Workload, n: int, concurrency: int
                      ) -> tuple[list, float, float]:
    """n requests, `concurrency` at a time, back to back (a 429 waits 0.1 s). Returns (results,
    seconds, completions per second once the loop was full: from the `concurrency`-th 200 to the
    last, so the ramp-up does not count)."""
    results: list[Result] = []
    done_at: list[float] = []
    left = n

    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            r = await send(client, "capacity", work.next())
            results.append(r)
            if r.status == 200:
                done_at.append(time.perf_counter())
            elif r.status == 429:
                await asyncio.sleep(0.1)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    k = min(concurrency, len(done_at) - 1)
    rate = (len(done_at) - 1 - k) / (done_at[-1] - done_at[k]) if k >= 0 and \
        done_at[-1] > done_at[k] else 0.0
    return results, time.perf_counter() - t0, rate


async def open_loop(client, work: Workload, phase: str, rate: float, n: int | None,
                    duration: float | None, rng: random.Random) -> tuple[list, float]:
    """Poisson arrivals at `rate` req/s until n requests were sent or `duration` s passed;
    waits for every answer. Returns (results, seconds over which they were sent)."""
    tasks = []
    t0 = time.perf_counter()
    next_t = 0.0
    while (n is None or len(tasks) < n) and (duration is None or next_t < duration):
        await asyncio.sleep(max(0.0, t0 + next_t - time.perf_counter()))
        tasks.append(asyncio.ensure_future(send(client, phase, work.next())))
        next_t += rng.expovariate(rate)
    sent_for = time.perf_counter() - t0
    return list(await asyncio.gather(*tasks)), sent_for


async def drain(client, timeout: float) -> tuple[dict, float]:
    """Poll /metrics until nothing runs, nothing waits and no KV block is in use, or timeout;
    returns (the last gauges, seconds waited)."""
    t0 = time.perf_counter()
    while True:
        g = gauges((await client.get("/metrics")).text)
        if (g["vllm:num_requests_running"] == 0 and g["vllm:num_requests_waiting"] == 0
                and g["vllm:kv_cache_usage_perc"] == 0):
            return g, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            return g, time.perf_counter() - t0
        await asyncio.sleep(0.05)


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    f = math.floor(k)
    return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)


# --------------------------------------------------------------------------------------- the run
def wait_ready(url: str, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 200 (a server just started loads its model first).

    Raises SystemExit naming the URL when it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"soak: {url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(0.5)


async def soak(args) -> dict:
    wait_ready(args.url, args.ready_timeout)
    pids = {"server": args.server_pid,
            "core": args.core_pid or find_core_pid(args.server_pid)}
    if pids["core"] is None:
        raise SystemExit("soak: no engine-core child of the server pid found; pass --core-pid")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout,
                                 limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        work = Workload(args, model)
        arrivals = random.Random(args.seed + 1)
        health = HealthPoller(args.url, args.health_interval, timeout=args.health_timeout,
                              pids=pids)
        health.start()
        t_start = health.t0
        polls_at = [0]  # len(health.latencies) where each phase ended

        async def phase_done(polled: bool = True) -> None:
            """End a phase; with `polled`, not before /health was polled once in it (a phase
            of requests usually has many polls; a short one on a loaded host may need to wait
            for the next: then polls_by_phase >= 1 says the poller lived through each)."""
            guard = time.perf_counter() + args.health_timeout + args.health_interval + 10
            while (polled and len(health.latencies) == polls_at[-1] and health.is_alive()
                   and time.perf_counter() < guard):
                await asyncio.sleep(0.01)
            polls_at.append(len(health.latencies))

        try:
            if args.capacity:
                capacity, cap_results, cap_s = args.capacity, [], 0.0
            else:
                cap_results, cap_s, capacity = await closed_loop(
                    client, work, args.capacity_requests, args.capacity_concurrency)
            await phase_done(polled=not args.capacity)
            if capacity <= 0:
                raise SystemExit("soak: the capacity run completed no request")
            rate = args.overload * capacity
            warm, _ = await open_loop(client, work, "warmup", rate, args.warmup_requests, None,
                                      arrivals)
            await phase_done()
            warm_gauges, _ = await drain(client, args.drain_timeout)
            await phase_done(polled=False)
            rss_start = {k: rss_kb(p) for k, p in pids.items()}
            t_main = time.perf_counter()
            main_from = t_main - t_start
            main, sent_for = await open_loop(client, work, "soak", rate, args.num_requests,
                                             args.duration, arrivals)
            main_s = time.perf_counter() - t_main
            await phase_done()
            end_gauges, drain_s = await drain(client, args.drain_timeout)
            await phase_done(polled=False)
            rss_end = {k: rss_kb(p) for k, p in pids.items()}
        finally:
            health.stop()
        total_s = time.perf_counter() - t_start

    everything = cap_results + warm + main
    status_counts: dict[str, int] = {}
    for r in everything:
        key = "transport_error" if r.status == 0 else str(r.status)
        status_counts[key] = status_counts.get(key, 0) + 1
    main_counts = {"200": 0, "429": 0, "5xx": 0, "other": 0}
    for r in main:
        main_counts["200" if r.status == 200 else "429" if r.status == 429
                    else "5xx" if 500 <= r.status < 600 else "other"] += 1
    ttfts = [r.ttft_s for r in main if r.status == 200 and r.ttft_s is not None]
    growth = {k: (rss_end[k] - rss_start[k]) / rss_start[k] for k in pids}
    report = {
        "url": args.url, "model": model, "pids": pids,
        "capacity_req_s": capacity, "capacity_measured": not args.capacity,
        "capacity_run": {"requests": len(cap_results), "seconds": cap_s,
                         "concurrency": args.capacity_concurrency},
        "overload": args.overload, "offered_rate_req_s": rate,
        "warmup_requests": len(warm),
        "soak_seconds": main_s, "soak_sent_over_s": sent_for,
        "requests_sent": len(main),
        "actual_offered_rate_req_s": len(main) / sent_for if sent_for else None,
        "status_counts": main_counts,
        "status_counts_all_phases": status_counts,
        "completed_req_s": main_counts["200"] / main_s if main_s else None,
        # no 429 at all: the server kept up, so this was no overload (the machine may have been
        # slower while the capacity was measured); not a failed check, but say so
        "overloaded": main_counts["429"] > 0,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "health_polls": len(health.latencies),
        # polls answered (or failed) while each phase ran: >= 1 in each phase of requests (see
        # phase_done) unless the poller died; the drains are short, may have none
        "health_polls_by_phase": dict(zip(
            ("capacity", "warmup", "warmup_drain", "soak", "soak_drain"),
            (b - a for a, b in zip(polls_at, polls_at[1:])))),
        "health_max_s": max(health.latencies) if health.latencies else None,
        "health_p99_s": percentile(health.latencies, 99),
        "health_failures": health.failures[:10],
        "rss_kb_start": rss_start, "rss_kb_end": rss_end, "rss_growth": growth,
        "rss_kb_max_in_soak": {k: max([s[i + 1] for s in health.rss_samples
                                       if main_from <= s[0] <= main_from + main_s]
                                      + [rss_start[k], rss_end[k]])
                               for i, k in enumerate(pids)},
        "rss_samples": {"columns": ["s", *[f"{k}_kb" for k in pids]],
                        "soak_from_s": round(main_from, 1),
                        "soak_to_s": round(main_from + main_s, 1), "rows": health.rss_samples},
        "after_warmup_gauges": warm_gauges,
        "after_drain_gauges": end_gauges, "drain_s": drain_s,
        "total_seconds": total_s,
        "errors": [asdict(r) for r in everything if r.error][:10],
    }
    report["checks"] = checks(report, args, everything)
    return report


def checks(rep: dict, args, everything: list[Result]) -> dict[str, str | None]:
    """Each check's failure message, None where it passed."""
    bad = [r for r in everything if r.status not in (200, 429) or r.error]
    five = [r for r in everything if 500 <= r.status < 600]
    g = rep["after_drain_gauges"]
    out = {
        "no_5xx": f"{len(five)} answers were 5xx" if five else None,
        "no_unexpected_answers": (f"{len(bad)} requests failed otherwise (first: "
                                  f"{bad[0].status} {bad[0].error})" if bad else None),
        "health_under_limit": None, "rss_growth_under_limit": None, "no_leaked_block": None,
    }
    hmax = rep["health_max_s"]
    if rep["health_failures"] or hmax is None or hmax >= args.health_limit_s:
        out["health_under_limit"] = (f"/health max {hmax} s (limit {args.health_limit_s} s), "
                                     f"failures {rep['health_failures'][:3]}")
    over = {k: v for k, v in rep["rss_growth"].items() if v >= args.rss_growth_limit}
    if over:
        out["rss_growth_under_limit"] = ", ".join(
            f"{k} RSS {rep['rss_kb_start'][k]} -> {rep['rss_kb_end'][k]} kB (+{v:.1%}, limit "
            f"{args.rss_growth_limit:.0%})" for k, v in over.items())
    if not (g["vllm:num_requests_running"] == 0 and g["vllm:num_requests_waiting"] == 0
            and g["vllm:kv_cache_usage_perc"] == 0):
        out["no_leaked_block"] = (f"{rep['drain_s']:.1f} s after the soak: running "
                                  f"{g['vllm:num_requests_running']}, waiting "
                                  f"{g['vllm:num_requests_waiting']}, KV usage "
                                  f"{g['vllm:kv_cache_usage_perc']}")
    return out


def render(rep: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:,.0f} ms"
    c, cap = rep["status_counts"], rep["capacity_run"]
    how = (f"measured: {cap['requests']} requests, closed loop of {cap['concurrency']}"
           if rep["capacity_measured"] else "given")
    lines = [
        f"soak of {rep['model']} at {rep['url']}",
        f"  capacity {rep['capacity_req_s']:.2f} req/s ({how}); "
        f"offered {rep['overload']}x = {rep['offered_rate_req_s']:.2f} req/s "
        f"(sent at {rep['actual_offered_rate_req_s'] or 0:.2f})",
        f"  duration {rep['soak_seconds']:.1f} s, {rep['requests_sent']} requests: "
        f"200 x {c['200']}, 429 x {c['429']}, 5xx x {c['5xx']}, other x {c['other']}; "
        f"{rep['completed_req_s'] or 0:.2f} req/s completed",
        f"  TTFT of the 200s: P50 {ms(rep['ttft_p50_s'])}, P99 {ms(rep['ttft_p99_s'])}, "
        f"max {ms(rep['ttft_max_s'])}",
        f"  /health: {rep['health_polls']} polls, max {ms(rep['health_max_s'])}, "
        f"P99 {ms(rep['health_p99_s'])}",
    ]
    for k in rep["pids"]:
        lines.append(f"  RSS {k} (pid {rep['pids'][k]}): {rep['rss_kb_start'][k] / 1024:,.1f} "
                     f"-> {rep['rss_kb_end'][k] / 1024:,.1f} MiB ({rep['rss_growth'][k]:+.2%}; "
                     f"max in the soak {rep['rss_kb_max_in_soak'][k] / 1024:,.1f} MiB)")
    g = rep["after_drain_gauges"]
    lines.append(f"  after drain ({rep['drain_s']:.2f} s): running "
                 f"{g['vllm:num_requests_running']:g}, waiting "
                 f"{g['vllm:num_requests_waiting']:g}, KV usage "
                 f"{g['vllm:kv_cache_usage_perc']:g}")
    if not rep["overloaded"]:
        lines.append("  warning: no request got 429, so the server was not overloaded (pass a "
                     "higher --capacity or --overload)")
    failed = {k: v for k, v in rep["checks"].items() if v}
    lines.append("  checks: " + ("all passed" if not failed else "FAILED: " + "; ".join(
        f"{k}: {v}" for k, v in failed.items())))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--server-pid", type=int, required=True,
                   help="pid of the server process (RSS); its engine-core child is found in /proc")
    p.add_argument("--core-pid", type=int, help="pid of the engine core (default: found)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for /health to answer 200 before starting")
    p.add_argument("--capacity", type=float, help="req/s; default: measured")
    p.add_argument("--capacity-requests", type=int, default=60)
    p.add_argument("--capacity-concurrency", type=int, default=8)
    p.add_argument("--overload", type=float, default=1.5, help="offered rate / capacity")
    p.add_argument("--warmup-requests", type=int, default=40)
    p.add_argument("--duration", type=float, help="seconds of soak (arrivals stop then)")
    p.add_argument("--num-requests", type=int, help="requests of soak (whichever comes first)")
    p.add_argument("--prompt-mix", default="8-32:0.5,64-160:0.35,200-350:0.15",
                   help="prompt words (~tokens) lo-hi:weight,...")
    p.add_argument("--output-tokens", default="8-32", help="max_tokens lo-hi (ignore_eos)")
    p.add_argument("--chat-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--health-interval", type=float, default=0.2)
    p.add_argument("--health-limit-s", type=float, default=1.0,
                   help="every /health must answer within this many seconds")
    p.add_argument("--health-timeout", type=float, default=5.0,
                   help="seconds a /health poll waits for its answer (none: a failure)")
    p.add_argument("--rss-growth-limit", type=float, default=0.05)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    if a.duration is None and a.num_requests is None:
        p.error("give --duration or --num-requests (or both)")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    rep = asyncio.run(soak(args))
    print(render(rep), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1)
    return 1 if any(rep["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
