"""Fidelity of ``sloserve sim`` against the real engine on this machine (issue 5's bar).

The embedded model is served with ``naive`` and ``chunked`` scheduling; ``sloserve bench``
drives the scaled ``mixed`` workload (the demo's: prompts 128/256/512 and 2048/4096 tokens x
0.25, outputs 30-80, ``ignore_eos``) at three Poisson rates. Each run gets a fresh server that
writes a step trace (``sloserve serve --step-trace``). Then every measured run is simulated with
the profiled cost model on the same requests and the same send times, and the table of relative
errors is printed (mean and P99 TTFT, P50 and P99 TPOT, output throughput).

The cost model is fitted to *calibration* runs only (another seed, other arrivals), never to
the run it predicts: one calibration run per policy (its server is configured differently),
whose step trace gives the step costs and whose bench result gives the server's own path
(``sloserve profile --from-trace T --bench-result R``). The report also shows the same
without the server path, one model pooled over both policies, and (``--grid-profile P.json``)
a model that ``sloserve profile`` fitted to an isolated engine.

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

from sloserve.bench.datasets import PromptFactory, mixed_workload
from sloserve.bench.metrics import calculate_metrics
from sloserve.bench.results import result_json, save_json
from sloserve.config import BATCHING_FLAGS
from sloserve.bench.runner import BenchConfig, run_benchmark
from sloserve.bench.server_proc import sloserve_server
from sloserve.sim.profile import (fit_with_holdout, frontend_delays, load_profile, save_profile,
                                  trace_samples)
from sloserve.sim.simulator import SimConfig, simulate
from sloserve.workload import SampleRequest

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
    args = [*BATCHING_FLAGS[policy], "--max-num-batched-tokens", str(BUDGET),
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
    from sloserve.embedded import default_model_path
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


def _calibrate(traces: list[str]):
    """(model, held-out errors, (request_in_s, token_out_s), samples, matched requests) from
    step traces and the bench results of the same runs."""
    samples = trace_samples(traces)
    model, err = fit_with_holdout(samples)
    into, outs = [], []
    for tr in traces:
        i, o = frontend_delays(tr, tr.replace("trace_", "measured_").replace(".jsonl", ".json"))
        into += i
        outs += o
    # a mean below 0 is matching noise (steps of ~15 ms against a client's clock): no delay
    fe = (max(0.0, float(np.mean(into))), max(0.0, float(np.mean(outs))))
    return model, err, fe, samples, len(into)


PRIMARY = "per-policy calibration run + server path"


def _runs(dirs: list[str]) -> dict[str, list[str]]:
    """Validation run name (``<policy>_r<rate>``) -> its result files, one per repetition."""
    runs: dict[str, list[str]] = {}
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(d, "measured_*.json"))):
            name = os.path.basename(p)[len("measured_"):-len(".json")]
            if not name.endswith("_cal"):
                runs.setdefault(name, []).append(p)
    return dict(sorted(runs.items()))


def _mean_metrics(results: list[dict]) -> dict[str, float]:
    return {key: float(np.mean([r[key] for r in results])) for _, key, _ in METRICS}


def report(a) -> int:
    cal = {os.path.basename(p)[len("trace_"):-len("_cal.jsonl")]: p
           for p in sorted(glob.glob(os.path.join(a.out, "trace_*_cal.jsonl")))}
    if not cal:
        print(f"no calibration traces in {a.out}; run `measure` first", file=sys.stderr)
        return 2
    dirs = [a.out, *a.repeats]
    runs = _runs(dirs)
    lines = [f"validation runs: {len(runs)} points x {max(len(v) for v in runs.values())} "
             f"repetition(s) ({', '.join(dirs)}); each figure below is the mean over the "
             f"repetitions, measured and simulated (each repetition simulated at its own send "
             f"times)", "", "calibration:"]
    fitted = {}
    for policy, tr in [*cal.items(), ("pooled", list(cal.values()))]:
        traces = tr if isinstance(tr, list) else [tr]
        model, err, fe, samples, nreq = _calibrate(traces)
        fitted[policy] = (model, fe)
        save_profile(os.path.join(a.out, f"profile_{policy}.json"), samples, model,
                     {"source": "step trace", "traces": [os.path.basename(t) for t in traces]},
                     {"request_in_s": fe[0], "token_out_s": fe[1], "requests": nreq})
        lines.append(f"- `{policy}`: {len(samples)} busy steps of "
                     f"{', '.join(os.path.basename(t) for t in traces)}; held-out step error "
                     f"mean {100 * err.mean():.1f} %, median {100 * float(np.median(err)):.1f} "
                     f"%; coefficients (s) " + ", ".join(f"{c:.3g}" for c in model.coef)
                     + f"; server path ({nreq} requests): send -> engine queue "
                     f"{1e3 * fe[0]:.1f} ms, first token's step end -> client {1e3 * fe[1]:.1f} "
                     f"ms (means)")
    lines.append("")

    def in_run(path: str, policy: str):
        r = _calibrate([path.replace("measured_", "trace_").replace(".json", ".jsonl")])
        return r[0], r[2]

    def leave_one_out(path: str, policy: str):
        name = os.path.basename(path).replace("measured_", "trace_").replace(".json", ".jsonl")
        others = [t for d in dirs for t in sorted(glob.glob(os.path.join(d, f"trace_{policy}_*.jsonl")))
                  if os.path.basename(t) != name]
        r = _calibrate(others)
        return r[0], r[2]
    variants = {
        PRIMARY: lambda path, pol: fitted[pol],
        "leave-one-out: every other run of the policy (all repetitions) + server path":
            leave_one_out,
        "per-policy calibration run, no server path": lambda path, pol: (fitted[pol][0], (0, 0)),
        "pooled calibration (one model for both policies) + server path":
            lambda path, pol: fitted["pooled"],
        "in-run: each run's own step trace + server path (not held out)": in_run,
    }
    if a.grid_profile:
        grid = load_profile(a.grid_profile)
        variants["grid profile (isolated engine) + server path"] = \
            lambda path, pol: (grid, fitted[pol][1])
    measured = {name: [json.load(open(p, encoding="utf-8")) for p in paths]
                for name, paths in runs.items()}
    if any(len(v) > 1 for v in measured.values()):
        lines += ["### measured run-to-run spread (same workload, same seed): (max - min) / "
                  "mean over the repetitions", "",
                  "| run | " + " | ".join(lab for lab, _, _ in METRICS) + " |",
                  "|---" * (len(METRICS) + 1) + "|"]
        for name, res in measured.items():
            cells = []
            for _, key, _ in METRICS:
                v = [r[key] for r in res]
                cells.append(f"{100 * (max(v) - min(v)) / np.mean(v):.1f} %")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    misses = 0
    for vname, pick in variants.items():
        lines += [f"### {vname}", "",
                  "| run | " + " | ".join(f"{lab} meas / sim / err" for lab, _, _ in METRICS)
                  + " | step time: sum err / mean abs err |",
                  "|---" * (len(METRICS) + 2) + "|"]
        for name, paths in runs.items():
            sims, step_errs = [], []
            for p, meas in zip(paths, measured[name]):
                cost, fe = pick(p, meas["scheduling_policy"])
                sims.append(_simulate_like(meas, cost, fe))
                tr = p.replace("measured_", "trace_").replace(".json", ".jsonl")
                step_errs.append(_step_error(cost, tr))
            m, sm = _mean_metrics(measured[name]), _mean_metrics(sims)
            cells = []
            for _, key, tol in METRICS:
                e = (sm[key] - m[key]) / m[key]
                miss = abs(e) > tol
                misses += miss and vname == PRIMARY
                cells.append(f"{m[key]:.0f} / {sm[key]:.0f} / {'**' if miss else ''}"
                             f"{100 * e:+.1f} %{'**' if miss else ''}")
            se = np.mean(step_errs, axis=0)
            cells.append(f"{100 * se[0]:+.1f} % / {100 * se[1]:.1f} %")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"bar: within 10 % on means/medians and output throughput, 20 % on P99s; "
                 f"misses (bold) with `{PRIMARY}`: {misses} of {len(runs) * len(METRICS)}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", allow_abbrev=False)
    m.add_argument("--out", default="benchmarks/results/fidelity")
    m.add_argument("--policies", default="naive,chunked")
    m.add_argument("--rates", default="0.4,0.8,1.1", help="Poisson req/s of the validation runs")
    m.add_argument("--num-prompts", type=int, default=120)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--calibration-rate", type=float, default=1.0)
    m.add_argument("--calibration-prompts", type=int, default=60, help="0: skip calibration")
    m.add_argument("--calibration-seed", type=int, default=1)
    r = sub.add_parser("report", allow_abbrev=False)
    r.add_argument("--out", default="benchmarks/results/fidelity")
    r.add_argument("--grid-profile", default=None)
    r.add_argument("--repeats", nargs="*", default=[],
                   help="more `measure --calibration-prompts 0` output folders: repetitions of "
                        "the same validation runs")
    a = ap.parse_args(argv)
    if a.cmd == "measure":
        measure(a)
        return 0
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
