"""Fidelity of ``sloserve sim`` against the real engine on this machine (issue 5's bar).

The embedded model is served with ``naive`` and ``chunked`` scheduling; ``sloserve bench``
drives the scaled ``mixed`` workload (the demo's: prompts 128/256/512 and 2048/4096 tokens x
0.25, outputs 30-80, ``ignore_eos``) at three Poisson rates. Each run gets a fresh server that
writes a step trace (``sloserve serve --step-trace``). Then every measured run is simulated with
the profiled cost model on the same requests and the same send times, and the table of relative
errors is printed (mean and P99 TTFT, P50 and P99 TPOT, output throughput).

The cost model is fitted to *calibration* runs only (another seed, other arrivals), never to
the run it predicts: ``trace`` fits the busy steps of the calibration runs' step traces
(``sloserve profile --from-trace``); ``--grid-profile P.json`` adds a model fitted by
``sloserve profile`` to an isolated engine, for comparison.

    .venv/bin/python benchmarks/fidelity.py measure --out benchmarks/results/fidelity
    .venv/bin/python benchmarks/fidelity.py report --out benchmarks/results/fidelity \\
        [--grid-profile profile.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

from sloserve.bench.datasets import PromptFactory, SampleRequest, mixed_workload
from sloserve.bench.metrics import calculate_metrics
from sloserve.bench.results import result_json, save_json
from sloserve.bench.runner import BenchConfig, run_benchmark
from sloserve.bench.server_proc import sloserve_server
from sloserve.sim.profile import (fit_with_holdout, frontend_delays, load_profile, save_profile,
                                  trace_samples)
from sloserve.sim.simulator import SimConfig, simulate

BUDGET = 256
SCALE = 0.25
#: (metric label, key in a result JSON, tolerance): 10 % on means/medians, 20 % on P99s
METRICS = (("mean TTFT", "mean_ttft_ms", 0.10), ("P99 TTFT", "p99_ttft_ms", 0.20),
           ("P50 TPOT", "median_tpot_ms", 0.10), ("P99 TPOT", "p99_tpot_ms", 0.20),
           ("output tok/s", "output_throughput", 0.10))


def _measure_one(out: str, name: str, policy: str, rate: float, n: int, seed: int, tok) -> None:
    reqs = mixed_workload(PromptFactory(tok, seed=seed), n, scale=SCALE, seed=seed)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    trace = os.path.join(out, f"trace_{name}.jsonl")
    args = ["--scheduling-policy", policy, "--max-num-batched-tokens", str(BUDGET),
            "--step-trace", trace]
    t0 = time.perf_counter()
    with sloserve_server(args, quiet=True) as base:
        bc = BenchConfig(base_url=base, model="embedded", request_rate=rate, seed=seed,
                         ignore_eos=True, progress=False)
        from sloserve.bench.tokenizer import server_models
        bc.model = server_models(base)[0]["id"]
        run = run_benchmark(bc, reqs, count)
    save_json(result_json(run, label=f"measured {name}", detailed=True,
                          metadata={"scheduling_policy": policy, "max_num_batched_tokens": BUDGET,
                                    "request_rate": rate, "seed": seed}),
              os.path.join(out, f"measured_{name}.json"))
    m = run.metrics
    print(f"{name}: {m.completed} ok / {m.failed} failed in {run.duration:.0f} s "
          f"({time.perf_counter() - t0:.0f} s with the server's start); mean TTFT "
          f"{m.stats['ttft'].mean:.0f} ms, P50 TPOT {m.stats['tpot'].p(50):.0f} ms", flush=True)


def measure(a) -> None:
    from sloserve.bench.tokenizer import load_tokenizer
    from sloserve.model.loader import default_model_path
    os.makedirs(a.out, exist_ok=True)
    tok = load_tokenizer(default_model_path())
    for policy in a.policies.split(","):
        if a.calibration_prompts:
            _measure_one(a.out, f"{policy}_cal", policy, a.calibration_rate,
                         a.calibration_prompts, a.calibration_seed, tok)
    for rate in (float(r) for r in a.rates.split(",") if r):
        for policy in a.policies.split(","):
            _measure_one(a.out, f"{policy}_r{rate:g}", policy, rate, a.num_prompts, a.seed, tok)


def _simulate_like(measured: dict, cost, frontend=(0.0, 0.0)) -> dict:
    """Simulate the measured run's requests at its send times; the same keys as its JSON."""
    lens, outs = measured["input_lens"], measured["output_lens"]
    t = np.asarray(measured["start_times"], dtype=np.float64)
    arr = list(t - t.min())
    reqs = [SampleRequest("", int(i), int(o)) for i, o in zip(lens, outs)]
    cfg = SimConfig(max_num_batched_tokens=measured["max_num_batched_tokens"],
                    policy=measured["scheduling_policy"], num_kv_blocks=2848,
                    request_in_s=frontend[0], token_out_s=frontend[1])
    res = simulate(reqs, arr, cfg, cost)
    m = calculate_metrics(res.records, res.duration, start_time=0.0)
    return {"mean_ttft_ms": m.stats["ttft"].mean, "p99_ttft_ms": m.stats["ttft"].p(99),
            "median_tpot_ms": m.stats["tpot"].p(50), "p99_tpot_ms": m.stats["tpot"].p(99),
            "output_throughput": m.output_throughput}


def _step_error(cost, trace: str) -> tuple[float, float]:
    """(mean predicted / mean measured - 1, mean |relative error|) over a trace's busy steps."""
    s = trace_samples([trace])
    pred = np.array([cost.step_time(c) for c, _ in s])
    meas = np.array([t for _, t in s])
    return float(pred.sum() / meas.sum() - 1), float(np.mean(np.abs(pred - meas) / meas))


def report(a) -> int:
    cal = sorted(glob.glob(os.path.join(a.out, "trace_*_cal.jsonl")))
    if not cal:
        print(f"no calibration traces in {a.out}; run `measure` first", file=sys.stderr)
        return 2
    samples = trace_samples(cal)
    model, err = fit_with_holdout(samples)
    into, out = [], []
    for tr in cal:
        i, o = frontend_delays(tr, tr.replace("trace_", "measured_").replace(".jsonl", ".json"))
        into += i
        out += o
    frontend = (float(np.mean(into)), float(np.mean(out)))
    save_profile(os.path.join(a.out, "profile_trace.json"), samples, model,
                 {"source": "step trace", "traces": [os.path.basename(p) for p in cal]},
                 {"request_in_s": frontend[0], "token_out_s": frontend[1], "requests": len(into)})
    models = {"trace + server path": (model, frontend), "trace, no server path": (model, (0, 0))}
    if a.grid_profile:
        models["grid + server path"] = (load_profile(a.grid_profile), frontend)
    lines = [f"cost model `trace`: fitted to {len(samples)} busy steps of "
             f"{', '.join(os.path.basename(p) for p in cal)}; held-out step error mean "
             f"{100 * err.mean():.1f} %, median {100 * float(np.median(err)):.1f} %",
             "coefficients (s): " + ", ".join(f"{c:.3g}" for c in model.coef),
             f"server path (same runs, {len(into)} requests): send -> engine queue "
             f"{1e3 * frontend[0]:.1f} ms, first token's step end -> client "
             f"{1e3 * frontend[1]:.1f} ms (means)", ""]
    runs = sorted(p for p in glob.glob(os.path.join(a.out, "measured_*.json"))
                  if not p.endswith("_cal.json"))
    worst = 0
    for mname, (cost, fe) in models.items():
        lines += [f"### cost model `{mname}`", "",
                  "| run | " + " | ".join(f"{lab} meas / sim / err" for lab, _, _ in METRICS)
                  + " | steps: sum err / mean abs err |",
                  "|---" * (len(METRICS) + 2) + "|"]
        for p in runs:
            meas = json.load(open(p, encoding="utf-8"))
            sim = _simulate_like(meas, cost, fe)
            name = os.path.basename(p)[len("measured_"):-len(".json")]
            cells = []
            for _, key, tol in METRICS:
                e = (sim[key] - meas[key]) / meas[key]
                miss = abs(e) > tol
                worst += miss and mname == "trace + server path"
                cells.append(f"{meas[key]:.0f} / {sim[key]:.0f} / {'**' if miss else ''}"
                             f"{100 * e:+.1f} %{'**' if miss else ''}")
            tr = os.path.join(a.out, f"trace_{name}.jsonl")
            se = _step_error(cost, tr) if os.path.exists(tr) else None
            cells.append(f"{100 * se[0]:+.1f} % / {100 * se[1]:.1f} %" if se else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"bar: within 10 % on means/medians and output throughput, 20 % on P99s; "
                 f"misses (bold) with `trace + server path`: {worst}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", default="benchmarks/results/fidelity")
    m.add_argument("--policies", default="naive,chunked")
    m.add_argument("--rates", default="0.4,0.8,1.2", help="Poisson req/s of the validation runs")
    m.add_argument("--num-prompts", type=int, default=120)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--calibration-rate", type=float, default=1.0)
    m.add_argument("--calibration-prompts", type=int, default=60, help="0: skip calibration")
    m.add_argument("--calibration-seed", type=int, default=1)
    r = sub.add_parser("report")
    r.add_argument("--out", default="benchmarks/results/fidelity")
    r.add_argument("--grid-profile", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "measure":
        measure(a)
        return 0
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
