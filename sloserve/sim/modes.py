"""The four things ``sloserve sim`` does with a configured simulation, each printing its report:
one run (the bench's summary and JSON), a rate sweep, a capacity search, a preset."""
from __future__ import annotations

import math
import os
import sys
import time

from sloserve.sim.setup import SimSetup


def run(a) -> int:
    """Simulate, print the summary, save the JSON (or a sweep, a capacity search, a preset).
    Returns the exit code."""
    from sloserve.bench.results import format_summary, result_json, save_json
    from sloserve.bench.runner import BenchConfig, BenchmarkRun
    if a.save_result:  # fail before the run, not after it
        path = os.path.abspath(a.save_result)
        parent = os.path.dirname(path)
        if os.path.isdir(path) or (os.path.exists(parent) and not os.path.isdir(parent)):
            raise ValueError(f"--save-result {a.save_result}: not a writable file path")
    sim = SimSetup(a)
    if a.preset:
        return run_preset(sim)
    if a.find_capacity:
        return run_capacity(sim)
    if a.request_rates:
        return run_sweep(sim)
    t0 = time.perf_counter()
    res, metrics = sim.run(a.request_rate)
    wall = time.perf_counter() - t0
    bc = BenchConfig(base_url="sim://", model=a.label, request_rate=a.request_rate,
                     percentiles=sim.percentiles,
                     burstiness=a.burstiness, seed=a.seed, goodput=sim.slos,
                     max_concurrency=a.max_concurrency)
    run_ = BenchmarkRun(bc, sim.reqs, res.records, 0.0, res.duration, metrics)
    extra = f"; {res.spec_summary()}" if res.num_draft_tokens else ""
    if res.kv_transfer_s:
        extra += (f"; KV transfer exposed mean {1e3 * sum(res.kv_transfer_s) / len(res.kv_transfer_s):.2f}"
                  f" ms, max {1e3 * max(res.kv_transfer_s):.2f} ms")
    print(f"sim: {sim.describe()}; {res.num_preemptions} preemptions; mean requests in flight "
          f"{res.mean_in_flight:.2f}{extra}; {len(sim.reqs) / wall:.0f} requests simulated per s "
          f"of wall time", file=sys.stderr)
    print(format_summary(metrics, title="Simulated Serving Benchmark Result", metrics=sim.shown))
    if a.save_result or a.report:
        res_json = result_json(run_, label=a.label, detailed=True, metrics=sim.shown,
                               metadata={"simulated": True, "scheduling_policy": sim.cfg.policy,
                                         "max_num_batched_tokens": sim.cfg.max_num_batched_tokens,
                                         "cost_model": sim.cost_name})
    if a.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(a.save_result)), exist_ok=True)
        save_json(res_json, a.save_result)
        print(f"result: {a.save_result}")
    if a.report:
        from sloserve.bench.report import write_report
        print("report:", write_report(a.report, {a.label: res_json}, slos=sim.slos, argv=a.command,
                                      title=f"sloserve sim: {sim.describe()}"))
    return 0


def run_sweep(sim: SimSetup) -> int:
    """--request-rates: one simulated run per rate; the bench sweep's table, JSON and plot."""
    from sloserve.bench.results import metrics_dict
    from sloserve.bench.sweep import write_sweep
    a = sim.a
    os.makedirs(a.result_dir, exist_ok=True)
    rows = []
    for rate in a.request_rates:
        _, m = sim.run(rate)
        rows.append({"point": rate, **metrics_dict(m)})
    print(f"sim sweep: {sim.describe()}", file=sys.stderr)
    sweep = write_sweep(rows, "request_rate", sim.slos, a.result_dir,
                        f"simulated: {sim.cfg.policy}, budget {sim.cfg.max_num_batched_tokens}")
    if a.report:
        from sloserve.bench.report import write_report
        print("report:", write_report(a.report, {f"rate {r['point']:g}": r for r in rows},
                                      sweep=sweep, slos=sim.slos, argv=a.command,
                                      title=f"sloserve sim sweep: {sim.describe()}"))
    return 0


def run_capacity(sim: SimSetup) -> int:
    """--find-capacity: bisect the rate; print it and the run at it."""
    from sloserve.sim.simulator import find_capacity
    a = sim.a
    if a.slo_attainment is not None:
        if not sim.slos:
            raise ValueError("--slo-attainment needs the per-request limits in --goodput "
                             "(e.g. --goodput ttft:2000 tpot:40)")
        if not 0 < a.slo_attainment <= 1:
            raise ValueError(f"--slo-attainment must be in (0, 1], got {a.slo_attainment}")
        limits = (f"{100 * a.slo_attainment:g} % of requests within "
                  + " and ".join(f"{k.upper()} {v:g} ms" for k, v in sim.slos.items()))

        def meets(m):
            return m.num_good >= a.slo_attainment * (m.completed + m.failed)
    else:
        slos = {"ttft": a.slo_p99_ttft_ms, "tpot": a.slo_p99_tpot_ms}
        slos = {k: v for k, v in slos.items() if v is not None}
        if not slos:
            raise ValueError("--find-capacity needs --slo-p99-ttft-ms and/or --slo-p99-tpot-ms, "
                             "or --slo-attainment with --goodput")
        limits = ", ".join(f"P99 {k.upper()} <= {v:g} ms" for k, v in slos.items())

        def meets(m):
            return m.failed == 0 and all(m.stats[k].p(99) <= v for k, v in slos.items())
    try:
        lo, hi = (float(x) for x in a.capacity_range.split(","))
    except ValueError:
        raise ValueError(f"--capacity-range takes LO,HI, got {a.capacity_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"--capacity-range must be finite, got {a.capacity_range!r}")
    cap = find_capacity(lambda r: sim.run(r)[1], meets, lo, hi)
    if cap is None:
        print(f"capacity: no rate in [{lo:g}, {hi:g}] req/s meets {limits} ({sim.describe()})")
        return 1
    m = sim.run(cap)[1]
    att = (f", attainment {100 * m.num_good / max(1, m.completed + m.failed):.1f} %"
           if sim.slos else "")
    print(f"capacity: {cap:.3f} req/s meets {limits} ({sim.describe()}); there: P99 TTFT "
          f"{m.stats['ttft'].p(99):.1f} ms, P99 TPOT {m.stats['tpot'].p(99):.1f} ms, output "
          f"{m.output_throughput:.1f} tok/s{att}" + (" (the top of the range)" if cap == hi else ""))
    return 0


def run_preset(sim: SimSetup) -> int:
    """--preset: naive against chunked (the --max-num-batched-tokens budget) on one workload."""
    from dataclasses import replace
    a = sim.a
    rows = []
    for policy in ("naive", "chunked"):
        cfg = replace(sim.cfg, policy=policy)
        res, m = sim.run(a.request_rate, cfg)
        t = m.stats["tpot"]
        rows.append((policy, t.p(50), t.p(90), t.p(99), m.stats["ttft"].mean,
                     m.stats["ttft"].p(99), m.output_throughput, res.num_preemptions, m.failed))
    print(f"preset {a.preset}: {sim.describe(cfg).replace('policy chunked', 'naive vs chunked')}"
          f", Poisson {a.request_rate:g} req/s, seed {a.seed}, {sim.num_kv_blocks} KV blocks of "
          f"{a.block_size}")
    print("| policy | TPOT P50 ms | TPOT P90 ms | TPOT P99 ms | TTFT mean ms | TTFT P99 ms "
          "| output tok/s | preemptions | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} "
              f"| {r[6]:.1f} | {r[7]} | {r[8]} |")
    n, c = rows
    rel = lambda new, old: f"{100 * (new - old) / old:+.1f} %" if old else "n/a"  # noqa: E731
    print(f"chunked vs naive: P99 TPOT {rel(c[3], n[3])}, mean TTFT {rel(c[4], n[4])}")
    if n[8] or c[8]:
        print(f"{n[8]} (naive) and {c[8]} (chunked) of {len(sim.reqs)} requests failed (over "
              f"max_model_len or the KV cache): the figures cover the rest")
        return 1
    return 0
