"""``sloserve profile``: time the real engine over a grid of step compositions and fit the
simulator's linear cost model (:class:`~sloserve.sim.cost_model.LinearCostModel`).

Grid: pure decode steps (batch x context), hybrid steps (decodes + one prefill chunk at a
start position), whole-prompt prefills, and verify steps (speculative decoding: batch x k
draft tokens per decode, what ``benchmarks/verify_cost.py`` measures). Every point is the median
of a few timed steps after warm-up (``sloserve.tools.step_profile``): decode, hybrid and verify
points time the model runner's whole ``execute`` on plain-data steps of that composition
(inputs, forward, sampling; not the scheduler), prefill points the engine's whole ``step()``.
The engine's quantized step limit (``WorkerInfo.quantized_step_max_tokens``, measured at its
start-up) is the fit's dense-GEMM crossover and is saved with it. Every fourth point is held out
of the fit and the fit's relative error on it is printed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict

import numpy as np

from sloserve.jsonl import read_json, read_jsonl
from sloserve.sim.cost_model import FEATURES, LinearCostModel, StepComposition

DECODE_GRID = [(b, c) for b in (1, 8, 16) for c in (128, 512)]
MIXED_GRID = [(b, n) for b in (1, 8, 16) for n in (32, 128, 256, 512)]
PREFILL_GRID = [64, 256, 512, 1024]
#: (batch, draft tokens per decode) of the verify points: on the AMX host's 16-token quantized
#: limit, batch 1 and (4, 1..2) stay on the quantized kernels, (4, 4..8) and batch 16 cross it
VERIFY_GRID = [(b, k) for b in (1, 4, 16) for k in (1, 2, 4, 8)]


def time_verify_steps(eng, batch: int, context_len: int, k: int, warmup: int,
                      repeats: int) -> list:
    """``repeats`` timed verify steps: ``batch`` decodes at context about ``context_len``, each
    with ``k`` draft tokens (the vocabulary's last id, which the greedy model does not pick, as
    ``step_profile.time_decode_steps(spec_tokens=k)``), run on the engine's model runner as
    plain-data scheduler outputs like ``step_profile.time_mixed_steps``'s decodes (so their
    times compare with the decode grid's: no scheduler). Step j's decodes compute positions
    ``context_len + j .. context_len + j + k``; ``StepSample.context`` is the context after
    it, drafts included (``SchedulerOutput.composition()``'s).

    Raises:
        ValueError: the engine has requests in flight, or too few KV blocks.
    """
    import time

    from sloserve.sampling_params import SamplingParams
    from sloserve.step_io import ScheduledRequest, SchedulerOutput
    from sloserve.tools.step_profile import StepSample
    if eng.has_unfinished_requests():
        raise ValueError("time_verify_steps needs an idle engine (its blocks are used directly)")
    steps = warmup + repeats
    bs = eng.config.block_size
    per = -(-(context_len + steps + k) // bs)
    if batch * per > eng.num_kv_blocks:
        raise ValueError(f"{batch} decodes at context {context_len} with {k} drafts for "
                         f"{steps} steps need {batch * per} KV blocks; the engine has "
                         f"{eng.num_kv_blocks}")
    greedy = SamplingParams(temperature=0.0, max_tokens=k + 2)
    draft = [eng.model_config.vocab_size - 1] * k
    out = []
    for j in range(steps):
        ctx = context_len + j + 1
        sched = [ScheduledRequest(f"profile-v{i}", ctx - 1, 1 + k, [10 + i, *draft],
                                  list(range(i * per, (i + 1) * per)), greedy, samples=True,
                                  is_decode=True, spec_token_ids=list(draft))
                 for i in range(batch)]
        t0 = time.perf_counter()
        ro = eng.runner.execute(SchedulerOutput(sched))
        wall = time.perf_counter() - t0
        if j >= warmup:
            out.append(StepSample(wall, ro.prepare_s, ro.forward_s, ro.sample_s, ctx + k))
    return out


def quantized_step_max_tokens(eng) -> int:
    """The engine's quantized step limit (its worker's, 0 without quantized weights)."""
    return int(eng.core.model_executor.get_model_info().quantized_step_max_tokens or 0)


def profile_engine(eng, repeats: int = 3, context_len: int = 256,
                   log=lambda s: None) -> list[tuple[StepComposition, float]]:
    """Median step seconds of every grid point on ``eng`` (an LLMEngine, chunked policy)."""
    from sloserve.tools.step_profile import time_mixed_steps, time_prefill_steps
    out: list[tuple[StepComposition, float]] = []

    def med(samples):
        return statistics.median(s.wall_s for s in samples)
    for b, ctx in DECODE_GRID:
        s = time_mixed_steps(eng, b, ctx, 0, warmup=2, repeats=repeats)
        mid = s[len(s) // 2].context
        out.append((StepComposition((mid,) * b, ()), med(s)))
        log(f"decode B={b} ctx={ctx}: {out[-1][1] * 1e3:.1f} ms")
    for b, n in MIXED_GRID:
        s = time_mixed_steps(eng, b, context_len, n, warmup=2, repeats=repeats)
        mid = len(s) // 2
        start = n * (2 + mid)  # the chunk of timed step k starts at n * (warmup + k)
        out.append((StepComposition((s[mid].context,) * b, ((n, start),)), med(s)))
        log(f"decode B={b} + chunk {n}: {out[-1][1] * 1e3:.1f} ms")
    for n in PREFILL_GRID:
        s = time_prefill_steps(eng, n, warmup=1, repeats=repeats)
        out.append((StepComposition((), ((n, 0),)), med(s)))
        log(f"prefill {n}: {out[-1][1] * 1e3:.1f} ms")
    for b, k in VERIFY_GRID:
        s = time_verify_steps(eng, b, context_len, k, warmup=2, repeats=repeats)
        out.append((StepComposition((s[len(s) // 2].context,) * b, (), (k,) * b), med(s)))
        log(f"verify B={b} k={k}: {out[-1][1] * 1e3:.1f} ms")
    return out


def trace_samples(paths) -> list[tuple[StepComposition, float]]:
    """(composition, seconds) pairs from ``sloserve serve --step-trace`` files: a step's cost is
    the time from its start to the next step's start while the engine stays busy (requests
    running or waiting after it), so what the serving process spends between steps (streaming
    outputs, taking new requests) is in it. Steps followed by idle time are left out (nothing
    left after the step, or a gap over :data:`IDLE_GAP_S` before the next one: an abort).

    Raises:
        FileNotFoundError: a missing file; ValueError: a line that is not a step record.
    """
    out: list[tuple[StepComposition, float]] = []
    for path in paths:
        rows = read_jsonl(path, _step_row, "step-trace record")
        for (t, step_s, busy, comp), (t_next, *_) in zip(rows, rows[1:]):
            if busy and t_next > t and t_next - t - step_s < IDLE_GAP_S:
                out.append((comp, t_next - t))
    return out


def _step_row(d: dict) -> tuple[float, float, int, StepComposition]:
    """(start time, step seconds, requests running or waiting after it, composition). A line
    without ``decode_drafts`` (no verify step, or a trace of before speculative decoding) has
    none."""
    drafts = d.get("decode_drafts", [])
    if not all(isinstance(d[k], list) for k in ("decode_contexts", "prefill_chunks")) \
            or not isinstance(drafts, list):
        raise ValueError("decode_contexts, prefill_chunks and decode_drafts must be lists")
    t, step_s = float(d["t"]), float(d["step_s"])
    if not (math.isfinite(t) and 0 <= step_s < math.inf):
        raise ValueError(f"bad times t={t}, step_s={step_s}")
    return (t, step_s, int(d["running"]) + int(d["waiting"]),
            StepComposition(tuple(int(c) for c in d["decode_contexts"]),
                            tuple((int(n), int(st)) for n, st in d["prefill_chunks"]),
                            tuple(int(k) for k in drafts)))


#: a gap this long between one step's end and the next one's start means the engine idled
#: (a request aborted after the step left nothing to run); a busy engine's gaps are far shorter
IDLE_GAP_S = 0.5


def _trace_rows(path: str) -> list[dict]:
    """The trace's lines as checked dicts (``t``, ``step_s``, ``prefill_chunks``, ``admitted``)."""
    def check(d: dict) -> dict:
        _step_row(d)
        for a, n in d.get("admitted", []):
            float(a), int(n)
        return d
    return read_jsonl(path, check, "step-trace record")


def _last_prefill_step(rows: list[dict], k: int, plen: int) -> int | None:
    """Index of the step that finishes the prefill of a ``plen``-token prompt admitted in step
    ``k``: follow its chunks (the next one starts where the last ended) until they reach
    ``plen``; None if the trace ends first."""
    pos = 0
    while k < len(rows):
        for n, st in rows[k]["prefill_chunks"]:
            if st == pos and (pos > 0 or n <= plen):
                pos += n
                break
        if pos >= plen:
            return k
        k += 1
    return None


def frontend_delays(trace: str, bench_result: str) -> tuple[list[float], list[float]]:
    """The server's own path, measured: (send -> engine queue, first token's step end ->
    client) seconds per request of a ``sloserve bench --save-detailed`` run against a server
    that wrote ``trace`` (``--step-trace``). Both use the machine's monotonic clock.

    Requests are matched in time order by prompt length (a trace's ``admitted`` entries against
    the result's ``start_times`` and ``input_lens``); the first token's step is the one where
    the request's chunks, followed from its admission, reach the prompt's length. A match whose
    token would have reached the client before its step ended is a wrong one, left out.

    Raises:
        ValueError: the result has no per-request times, or nothing matched.
    """
    res = read_json(bench_result)
    keys = ("start_times", "input_lens", "ttfts", "errors")
    if not isinstance(res, dict) or not all(isinstance(res.get(k), list) for k in keys):
        raise ValueError(f"{bench_result}: no per-request times (run the bench with "
                         f"--save-detailed)")
    if len({len(res[k]) for k in keys}) != 1:
        raise ValueError(f"{bench_result}: {', '.join(keys)} differ in length")
    try:
        reqs = sorted((float(s), int(n), float(t or 0.0), e) for s, n, t, e in
                      zip(*(res[k] for k in keys)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{bench_result}: bad per-request values ({e})") from None
    rows = _trace_rows(trace)
    adm = sorted((a, n, k) for k, r in enumerate(rows) for a, n in r.get("admitted", []))
    into, out, j = [], [], 0
    for send, plen, ttft, err in reqs:
        if err or not ttft:
            continue
        m = j
        while m < len(adm) and (adm[m][1] != plen or adm[m][0] < send - 1e-3):
            m += 1
        if m == len(adm):
            break
        arrival, _, k = adm[m]
        k = _last_prefill_step(rows, k, plen)
        if k is None:
            j = m + 1
            continue
        to_client = send + ttft - (rows[k]["t"] + rows[k]["step_s"])
        if to_client < 0:  # its token reached the client before that step ended: not its
            continue       # admission (left for the next request)
        j = m + 1
        into.append(arrival - send)
        out.append(to_client)
    if not into:
        raise ValueError(f"{bench_result} does not look like the run of {trace}: none of its "
                         f"requests matched a step of it")
    med_in, med_out = float(np.median(into)), float(np.median(out))
    if not (0 <= med_in < 10 and 0 <= med_out < 10):
        raise ValueError(f"{bench_result} does not look like the run of {trace}: the median "
                         f"send -> engine is {med_in:.3f} s and step end -> client "
                         f"{med_out:.3f} s")
    return into, out


def fit_with_holdout(samples, quantized_step_max_tokens: int = 0):
    """(model fitted on all points, relative errors on every 4th point of a fit without them);
    ``quantized_step_max_tokens``: the dense-GEMM crossover (0: none)."""
    held = samples[3::4]
    train = [s for i, s in enumerate(samples) if i % 4 != 3]
    return (LinearCostModel.fit(samples, quantized_step_max_tokens),
            LinearCostModel.fit(train, quantized_step_max_tokens).relative_errors(held))


def save_profile(path: str, samples, model: LinearCostModel, meta: dict,
                 frontend: dict | None = None) -> None:
    """Write the measured table, the fitted coefficients, the quantized step limit they assume
    and (when measured) the server-path delays (``frontend``: request_in_s, token_out_s) as
    JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "features": list(FEATURES), "coef": model.coef,
                   "quantized_step_max_tokens": model.quantized_step_max_tokens,
                   "defaulted": list(model.defaulted), "frontend": frontend,
                   "samples": [{"composition": asdict(c), "seconds": t} for c, t in samples]},
                  f, indent=1)


def _read_profile(path: str) -> dict:
    d = read_json(path)
    if not isinstance(d, dict) or "coef" not in d:
        raise ValueError(f"{path}: not a `sloserve profile` file (no 'coef')")
    return d


def load_frontend(path: str) -> tuple[float, float]:
    """(request_in_s, token_out_s) of a profile file: the server-path delays measured with
    ``--bench-result``, else (0, 0).

    Raises:
        FileNotFoundError, ValueError: missing file, not a profile, delays that are not finite
            numbers >= 0.
    """
    fe = _read_profile(path).get("frontend") or {}
    try:
        into, out = float(fe.get("request_in_s", 0.0)), float(fe.get("token_out_s", 0.0))
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"{path}: 'frontend' must hold request_in_s and token_out_s "
                         f"(seconds), got {fe!r}") from None
    if not (0 <= into < math.inf and 0 <= out < math.inf):
        raise ValueError(f"{path}: server-path delays must be finite and >= 0, got {into}, {out}")
    return into, out


def load_profile(path: str) -> LinearCostModel:
    """The fitted model of a profile file. A profile of before the verify terms (6 or 5
    coefficients, no ``quantized_step_max_tokens``) loads with their defaults
    (:class:`~sloserve.sim.cost_model.LinearCostModel`: a draft token priced as a prefill
    token, no crossover).

    Raises:
        FileNotFoundError, ValueError: missing file, or not a profile (no valid ``coef``).
    """
    d = _read_profile(path)
    try:
        return LinearCostModel(d["coef"], d.get("quantized_step_max_tokens", 0),
                               tuple(d.get("defaulted") or ()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """``sloserve profile [--out FILE] [engine flags]``."""
    from sloserve.config import add_engine_args, engine_config_from_args
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="sloserve profile", description=__doc__)
    add_engine_args(ap)
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--from-trace", nargs="+", default=None, metavar="TRACE.jsonl",
                    help="fit to the steps of `sloserve serve --step-trace` files instead of "
                         "timing a grid (no model is loaded)")
    ap.add_argument("--bench-result", nargs="+", default=None, metavar="RESULT.json",
                    help="with --from-trace: the `sloserve bench --save-detailed` result of "
                         "each trace's run, in the same order; measures the server's path "
                         "(send -> engine queue, step end -> client) for the simulator")
    ap.add_argument("--quantized-step-max-tokens", type=int, default=None, metavar="N",
                    help="with --from-trace: the traced server's quantized step limit (its "
                         "start-up line: 'steps of <= N tokens on the quantized weights', or "
                         "'every step (<= N tokens)' there), the "
                         "fit's dense-GEMM crossover (default 0: none; a grid run measures it)")
    a = ap.parse_args(argv)
    if a.bench_result and not a.from_trace:
        print("sloserve profile: error: --bench-result goes with --from-trace (the traces of "
              "the same runs)", file=sys.stderr)
        return 2
    if a.quantized_step_max_tokens is not None and (not a.from_trace
                                                    or a.quantized_step_max_tokens < 0):
        print("sloserve profile: error: --quantized-step-max-tokens goes with --from-trace "
              "(a grid run measures the limit) and must be >= 0", file=sys.stderr)
        return 2
    if a.from_trace:
        return _from_trace(a)
    from sloserve.engine.llm_engine import LLMEngine
    cfg = engine_config_from_args(a)
    cfg.enable_chunked_prefill, cfg.static_batching = True, False
    # the grid's largest whole-prompt prefill must fit one step (the decode and mixed points
    # run on the model runner directly, whatever the budget)
    cfg.max_num_batched_tokens = max(cfg.max_num_batched_tokens, max(PREFILL_GRID))
    try:
        eng = LLMEngine(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"sloserve profile: error: {e}", file=sys.stderr)
        return 2
    qmax = quantized_step_max_tokens(eng)
    samples = profile_engine(eng, a.repeats, log=lambda s: print(s, file=sys.stderr))
    model, err = fit_with_holdout(samples, qmax)
    save_profile(a.out, samples, model, {"model": eng.model_name, "dtype": eng.dtype_choice.dtype,
                                         "num_threads": cfg.num_threads,
                                         "quantized_step_max_tokens": qmax})
    _report(model, err, a.out, f"{len(samples)} grid points")
    print("note: this timed an isolated engine; a serving process pays more per step (HTTP, "
          "streams, the client on the same cores). To predict a server, fit the steps it ran: "
          "`sloserve serve --step-trace T.jsonl`, then `sloserve profile --from-trace T.jsonl "
          "--bench-result R.json` (docs/sim.md)")
    return 0


def _from_trace(a: argparse.Namespace) -> int:
    try:
        if a.bench_result and len(a.bench_result) != len(a.from_trace):
            raise ValueError(f"--bench-result needs one file per trace: {len(a.from_trace)} "
                             f"traces, {len(a.bench_result)} results")
        samples = trace_samples(a.from_trace)
        model, err = fit_with_holdout(samples, a.quantized_step_max_tokens or 0)
        frontend = None
        if a.bench_result:
            into, out = [], []
            for tr, res in zip(a.from_trace, a.bench_result):
                i, o = frontend_delays(tr, res)
                into += i
                out += o
            frontend = {"request_in_s": float(np.mean(into)), "token_out_s": float(np.mean(out)),
                        "requests": len(into)}
    except (ValueError, OSError) as e:
        print(f"sloserve profile: error: {e}", file=sys.stderr)
        return 2
    save_profile(a.out, samples, model, {"source": "step trace", "traces": a.from_trace},
                 frontend)
    if frontend:
        print(f"server path ({frontend['requests']} requests): send -> engine queue "
              f"{1e3 * frontend['request_in_s']:.1f} ms, step end -> client "
              f"{1e3 * frontend['token_out_s']:.1f} ms (means)")
    _report(model, err, a.out, f"{len(samples)} busy steps from {len(a.from_trace)} trace(s)")
    return 0


def _report(model: LinearCostModel, err, out: str, source: str) -> None:
    print(f"fit ({source}): t = "
          + " + ".join(f"{c:.3g}*{f}" for c, f in zip(model.coef, FEATURES)) + " (s); "
          + (f"dense_step: a step of over {model.quantized_step_max_tokens} tokens"
             if model.quantized_step_max_tokens else "no dense-GEMM crossover (limit unknown)"))
    if model.defaulted:
        print(f"not in the samples, defaulted: {', '.join(model.defaulted)} (a draft token "
              f"priced as a prefill token; no crossover term)")
    print(f"held-out relative error ({len(err)} points): mean {100 * err.mean():.1f} %, "
          f"median {100 * float(np.median(err)):.1f} %, max {100 * err.max():.1f} %")
    if len(err) < 6 or err.mean() > 0.2:
        print(f"warning: the fit is poor or rests on few points ({len(err)} held out, mean "
              f"error {100 * err.mean():.0f} %): a busy machine or a short trace; profile again "
              f"on a quiet machine or fit a longer trace", file=sys.stderr)
    print(f"profile written to {out}")
