"""``sloserve tune``: the scheduler settings that maximise goodput under an SLO, found in the
simulator (the engine's own scheduler over a cost model) and, with ``--verify N``, measured.

For a workload (``sloserve bench``'s dataset flags, or a recorded trace) at ``--request-rate``,
an SLO (``--goodput ttft:MS tpot:MS``) and a cost model (``--profile`` from ``sloserve
profile``, or the sim's other models), it simulates every configuration of the grid

    --max-num-batched-tokens   --budgets (default 128,256,512,1024,2048)
    --max-num-seqs             --max-num-seqs-grid (default 16,32,64,128)
    chunked prefill / whole    (--no-enable-chunked-prefill)
    --enable-prefill-pacing    on / off (chunked only)
    --long-prefill-token-threshold  --long-prefill-thresholds (default 0,256; chunked only)
    --scheduling-policy        fcfs / priority (when the workload's requests carry priorities,
                               a trace's ``priority`` field; with one priority for all, both
                               orders give one schedule and fcfs stays)

and ranks them by predicted goodput (requests/s within the SLO), then attainment, then the
fewest changes from the defaults (a configuration that does no better keeps the defaults), then
P99 TTFT and TPOT. The capacity (the highest rate whose attainment is at least ``--slo-attainment``) is
found for the top ``--capacity-top`` and the defaults. The goldilocks budget is the token
budget whose best configuration predicts the most goodput: a smaller one queues prefills (TTFT
rises), a larger one lets prefill chunks stall decodes (TPOT rises).

``--instances K`` searches a cluster's layout too: every configuration as K colocated
replicas (behind ``--router``) and as each split into P prefill + D decode instances
(P + D = K; the KV transfer priced by the sim's ``--kv-transfer-*`` flags); the defaults are
the K replicas.

``--verify N`` then starts ``sloserve serve`` (the embedded model, or ``--serve-model``) with
each of the top N and with the defaults, runs ``sloserve bench`` on the same requests
(``--verify-runs`` times, the configurations in turn), and prints predicted against measured
(one instance: a cluster's layouts are predicted only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from sloserve.argtypes import parse_given, pos_int
from sloserve.config import EngineConfig

#: the flags whose values tune searches (so they are not taken from the command line)
SEARCHED = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
            "enable_prefill_pacing", "long_prefill_token_threshold", "static_batching",
            "scheduling_policy")
#: sim flags that are other kinds of run
OTHER_RUNS = ("preset", "find_capacity", "request_rates", "save_result", "report",
              "slo_p99_ttft_ms", "slo_p99_tpot_ms")
#: the largest cluster --instances searches (each layout is simulated whole)
MAX_INSTANCES = 16
#: sim flags that --instances searches
LAYOUT_FLAGS = ("num_replicas", "num_prefill_instances", "num_decode_instances")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a cluster's instances serve: ``replicas`` colocated ones, or ``prefill`` +
    ``decode`` disaggregated ones (``prefill`` > 0)."""

    replicas: int = 1
    prefill: int = 0
    decode: int = 0

    def describe(self) -> str:
        if self.prefill:
            return f"{self.prefill} prefill + {self.decode} decode"
        return f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"


def layouts(k: int) -> list[Layout]:
    """K colocated replicas, then every P/D split of K."""
    return [Layout(k)] + [Layout(1, p, k - p) for p in range(1, k)]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the grid (the engine's defaults are one of them)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    chunked: bool = True
    pacing: bool = True
    long_prefill_token_threshold: int = 0
    #: the cluster's layout (None: the one on the command line)
    layout: Layout | None = None
    policy: str = "fcfs"

    @classmethod
    def defaults(cls, layout: Layout | None = None) -> "Candidate":
        d = EngineConfig()
        return cls(d.max_num_batched_tokens, d.max_num_seqs, d.enable_chunked_prefill,
                   d.enable_prefill_pacing, d.long_prefill_token_threshold, layout,
                   d.scheduling_policy)

    def serve_flags(self) -> list[str]:
        """The ``sloserve serve`` flags of this configuration (all of them, defaults too)."""
        return ["--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs),
                "--enable-chunked-prefill" if self.chunked else "--no-enable-chunked-prefill",
                "--enable-prefill-pacing" if self.pacing else "--no-enable-prefill-pacing",
                "--long-prefill-token-threshold", str(self.long_prefill_token_threshold),
                "--scheduling-policy", self.policy]

    def describe(self) -> str:
        where = f"{self.layout.describe()}: " if self.layout is not None else ""
        order = "" if self.policy == EngineConfig().scheduling_policy else f", {self.policy}"
        if not self.chunked:
            return (f"{where}budget {self.max_num_batched_tokens}, seqs {self.max_num_seqs}, "
                    f"whole prefill{order}")
        return (f"{where}budget {self.max_num_batched_tokens}, seqs {self.max_num_seqs}, "
                f"chunked, pacing {'on' if self.pacing else 'off'}, threshold "
                f"{self.long_prefill_token_threshold or 'none'}{order}")

    def distance(self, other: "Candidate") -> int:
        """Settings that differ (ties in the ranking go to the fewest changes from the
        defaults)."""
        return sum(getattr(self, f.name) != getattr(other, f.name)
                   for f in dataclasses.fields(self))

    def sim_config(self, base):
        """``base`` (a SimConfig) with this configuration's settings."""
        cfg = EngineConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                           max_num_seqs=self.max_num_seqs,
                           enable_chunked_prefill=self.chunked,
                           enable_prefill_pacing=self.pacing and self.chunked,
                           long_prefill_token_threshold=self.long_prefill_token_threshold)
        return dataclasses.replace(base, max_num_batched_tokens=self.max_num_batched_tokens,
                                   max_num_seqs=self.max_num_seqs, policy=cfg.batching,
                                   queue_policy=self.policy,
                                   enable_prefill_pacing=cfg.enable_prefill_pacing,
                                   long_prefill_token_threshold=self.long_prefill_token_threshold)


def grid(budgets, seqs, thresholds, layouts_: list[Layout] | None = None,
         policies: tuple[str, ...] = ("fcfs",)) -> list[Candidate]:
    out = []
    for lay in layouts_ or [None]:
        for pol in policies:
            for b in budgets:
                for s in seqs:
                    out.append(Candidate(b, s, chunked=False, pacing=False, layout=lay,
                                         policy=pol))
                    for pacing in (True, False):
                        for t in thresholds:
                            out.append(Candidate(b, s, True, pacing, t, lay, pol))
    d = Candidate.defaults(layouts_[0] if layouts_ else None)
    return out if d in out else [*out, d]


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return vals


def parser() -> argparse.ArgumentParser:
    from sloserve.sim.cli import _parser
    p = _parser()
    p.prog = "sloserve tune"
    p.description = __doc__
    t = p.add_argument_group("tune")
    t.add_argument("--budgets", type=_ints, default=[128, 256, 512, 1024, 2048],
                   metavar="N1,N2,...", help="--max-num-batched-tokens values searched")
    t.add_argument("--max-num-seqs-grid", type=_ints, default=[16, 32, 64, 128],
                   metavar="N1,N2,...", help="--max-num-seqs values searched")
    t.add_argument("--long-prefill-thresholds", type=_ints, default=[0, 256],
                   metavar="N1,N2,...", help="--long-prefill-token-threshold values searched "
                                             "(0: no cap)")
    t.add_argument("--instances", type=int, default=None, metavar="K",
                   help="search a cluster of K instances too: K colocated replicas (the "
                        "defaults) or P prefill + D decode instances, P + D = K (predicted "
                        "only; not with --verify)")
    t.add_argument("--top", type=pos_int, default=10, help="configurations printed")
    t.add_argument("--capacity-top", type=int, default=3,
                   help="configurations (and the defaults) whose capacity is bisected")
    t.add_argument("--verify", type=int, default=0, metavar="N",
                   help="start `sloserve serve` with each of the top N and with the defaults "
                        "and measure them with `sloserve bench` on the same requests (a "
                        "configuration predicted exactly as one ranked above it, e.g. a "
                        "--max-num-seqs that never binds, is skipped for the next)")
    t.add_argument("--verify-runs", type=pos_int, default=1,
                   help="bench runs per verified configuration (alternated)")
    t.add_argument("--serve-model", default=None,
                   help="the model `--verify` serves (default: the embedded one)")
    t.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `sloserve serve` argument for --verify, repeated, one token each: "
                        "--serve-arg=--dtype --serve-arg=float32")
    t.add_argument("--save-tune", default=None, metavar="FILE.json",
                   help="write every configuration's prediction (and measurements) here")
    return p


def _row(cand: Candidate, m, rate: float) -> dict[str, Any]:
    judged = m.completed + m.failed
    return {"config": cand.describe(), "flags": cand.serve_flags(), "rate": rate,
            **({"layout": dataclasses.asdict(cand.layout)} if cand.layout else {}),
            "goodput": m.request_goodput or 0.0,
            "attainment": m.num_good / judged if judged else 0.0,
            "p99_ttft_ms": m.stats["ttft"].p(99), "p99_tpot_ms": m.stats["tpot"].p(99),
            "failed": m.failed}


def _run(sim, cand: Candidate, rate: float):
    """The candidate simulated at ``rate``: (SimResult, BenchmarkMetrics)."""
    lay = cand.layout
    if lay is None:
        return sim.run(rate, cand.sim_config(sim.cfg))
    return sim.run(rate, cand.sim_config(sim.cfg), replicas=lay.replicas,
                   prefill=lay.prefill, decode=lay.decode)


def search(sim, cands: list[Candidate], rate: float) -> list[tuple[Candidate, dict]]:
    """Every candidate simulated at ``rate``, best first."""
    rows = []
    for c in cands:
        _, m = _run(sim, c, rate)
        rows.append((c, _row(c, m, rate)))
    d = Candidate.defaults(cands[0].layout)
    rows.sort(key=lambda cr: (-round(cr[1]["goodput"], 9), -round(cr[1]["attainment"], 9),
                              cr[0].distance(d), round(cr[1]["p99_ttft_ms"], 6),
                              round(cr[1]["p99_tpot_ms"], 6)))
    return rows


def capacity(sim, cand: Candidate, attainment: float, lo: float, hi: float) -> float | None:
    from sloserve.sim.simulator import find_capacity
    return find_capacity(lambda r: _run(sim, cand, r)[1],
                         lambda m: m.num_good >= attainment * (m.completed + m.failed),
                         lo, hi, iters=8)


def goldilocks(rows: list[tuple[Candidate, dict]]) -> list[tuple[int, dict]]:
    """The best row of each budget, by budget."""
    best: dict[int, dict] = {}
    for c, r in rows:  # rows are best first
        best.setdefault(c.max_num_batched_tokens, r)
    return sorted(best.items())


# ------------------------------------------------------------------------------ --verify
def _workload_argv(argv: list[str]) -> list[str]:
    """The tokens of ``argv`` that are ``sloserve bench``'s workload and arrival flags."""
    from sloserve.bench.workload_args import add_workload_args
    wp = argparse.ArgumentParser(add_help=False)
    add_workload_args(wp)
    known = {o for act in wp._actions for o in act.option_strings}
    out, keep = [], False
    for tok in argv:
        if tok.startswith("--"):
            keep = tok.split("=", 1)[0] in known
        if keep:
            out.append(tok)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sloserve serve exited with {proc.returncode} before /health")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"sloserve serve not healthy within {timeout:g} s")


def measure(cand: Candidate, a, workload: list[str], rate: float, out_dir: str,
            tag: str) -> dict[str, Any]:
    """Serve ``cand``, bench it once; the measured goodput, attainment and P99s."""
    port = _free_port()
    cmd = [sys.executable, "-m", "sloserve.cli", "serve", *([a.serve_model] if a.serve_model
                                                           else []),
           "--port", str(port), *cand.serve_flags(), *a.serve_arg]
    log = open(os.path.join(out_dir, f"{tag}.serve.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        name = f"{tag}.json"
        bench = [sys.executable, "-m", "sloserve.cli", "bench", "--port", str(port), *workload,
                 "--request-rate", f"{rate:g}", "--goodput",
                 *[f"{k}:{v:g}" for k, v in a.slos.items()], "--ignore-eos", "--disable-tqdm",
                 # a fcfs server refuses priorities: the fcfs order is the one ignoring them
                 *(["--ignore-priority"] if cand.policy == "fcfs" else []),
                 "--save-result", "--result-dir", out_dir, "--result-filename", name]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out_dir, name)) as f:
            res = json.load(f)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    judged = res["completed"] + res.get("failed", 0)
    good = round((res.get("request_goodput") or 0.0) * res["duration"])  # a count
    if res.get("failed"):
        print(f"tune: {res['failed']} of {judged} requests failed in that run (their errors: "
              f"{os.path.join(out_dir, name)})", file=sys.stderr)
    return {"goodput": res.get("request_goodput") or 0.0,
            "attainment": good / judged if judged else 0.0, "failed": res.get("failed", 0),
            "p99_ttft_ms": res.get("p99_ttft_ms"), "p99_tpot_ms": res.get("p99_tpot_ms")}


def distinct(rows: list[tuple[Candidate, dict]], n: int) -> list[tuple[Candidate, dict]]:
    """The first ``n`` rows whose predictions differ from every row kept before them (the
    same goodput, attainment and P99s: the simulator ran them alike, measuring both is
    measuring one twice)."""
    out, seen = [], set()
    for c, r in rows:
        key = (r["goodput"], r["attainment"], r["p99_ttft_ms"], r["p99_tpot_ms"])
        if key not in seen:
            seen.add(key)
            out.append((c, r))
            if len(out) == n:
                break
    return out


def verify(a, argv: list[str], picks: list[tuple[Candidate, dict]], rate: float,
           out_dir: str) -> list[dict]:
    workload = _workload_argv(argv)
    runs: dict[Candidate, list[dict]] = {c: [] for c, _ in picks}
    for i in range(a.verify_runs):
        for j, (c, _) in enumerate(picks):
            print(f"tune: verifying {c.describe()} (run {i + 1} of {a.verify_runs})",
                  file=sys.stderr)
            tag = f"verify-{j}-run{i}"
            try:
                runs[c].append(measure(c, a, workload, rate, out_dir, tag))
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                # a run that failed is left out of the medians, not the whole verification
                print(f"tune: that run failed ({e}); its server's log: "
                      f"{os.path.join(out_dir, tag + '.serve.log')}", file=sys.stderr)
    out = []
    for c, pred in picks:
        got = runs[c]
        med = {k: statistics.median(r[k] for r in got) if got else None
               for k in ("goodput", "attainment")}
        out.append({**pred, "measured": got, "measured_goodput": med["goodput"],
                    "measured_attainment": med["attainment"]})
    return out


# ------------------------------------------------------------------------------ main
def _fmt(x, d=2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def main(argv: list[str] | None = None) -> int:
    from sloserve.sim.setup import SimSetup
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    try:
        a, given = parse_given(p, argv)
        bad = sorted("--" + d.replace("_", "-") for d in given & set(OTHER_RUNS + SEARCHED))
        if bad:
            raise ValueError(f"{', '.join(bad)}: tune searches the scheduler settings itself "
                             f"(--budgets, --max-num-seqs-grid, --long-prefill-thresholds)")
        if a.verify < 0:
            raise ValueError(f"--verify must be >= 0, got {a.verify}")
        if a.instances is not None:
            if not 2 <= a.instances <= MAX_INSTANCES:
                raise ValueError(f"--instances must be 2..{MAX_INSTANCES} (a cluster of one "
                                 f"host's simulations), got {a.instances}")
            bad = sorted("--" + d.replace("_", "-") for d in given & set(LAYOUT_FLAGS))
            if bad:
                raise ValueError(f"{', '.join(bad)}: --instances searches the layout itself")
            if a.verify:
                raise ValueError("--verify serves one instance; a cluster's layouts "
                                 "(--instances) are predicted only")
        if not a.goodput:
            raise ValueError("tune needs the SLO: --goodput ttft:MS tpot:MS [e2el:MS]")
        a.slo_attainment = a.slo_attainment or 0.9
        if not 0 < a.slo_attainment <= 1:
            raise ValueError(f"--slo-attainment must be in (0, 1], got {a.slo_attainment}")
        sim = SimSetup(a)
        a.slos = sim.slos
        rate = a.request_rate
        if rate == float("inf") and not sim.trace_arrivals:
            raise ValueError("tune needs the load: --request-rate R (req/s), or a trace")
        lo, hi = (float(x) for x in a.capacity_range.split(","))
    except (ValueError, OSError, KeyError) as e:
        print(f"sloserve tune: error: {e.args[0] if isinstance(e, KeyError) else e}",
              file=sys.stderr)
        return 2
    lays = layouts(a.instances) if a.instances else None
    # the order matters only where requests differ in priority
    policies = (("fcfs", "priority") if len({r.priority for r in sim.reqs}) > 1
                else (EngineConfig().scheduling_policy,))
    cands = grid(a.budgets, a.max_num_seqs_grid, a.long_prefill_thresholds, lays, policies)
    t0 = time.perf_counter()
    rows = search(sim, cands, rate)
    where = f"layouts of {a.instances} instances" if lays else None
    at = "the trace's arrivals" if sim.trace_arrivals else f"{rate:g} req/s"
    print(f"tune: {len(cands)} configurations simulated in {time.perf_counter() - t0:.1f} s; "
          f"{sim.describe(where=where)}; at {at}; SLO "
          + ", ".join(f"{k} <= {v:g} ms" for k, v in sim.slos.items())
          + f", attainment >= {a.slo_attainment:g}", file=sys.stderr)
    default = Candidate.defaults(lays[0] if lays else None)
    by_cand = dict(rows)
    rank = {c: i + 1 for i, (c, _) in enumerate(rows)}
    shown = rows[:a.top] + ([(default, by_cand[default])] if rank[default] > a.top else [])
    # a trace replays its own arrivals: no rate to bisect
    for c, r in ([] if sim.trace_arrivals else rows[:a.capacity_top] + [(default, by_cand[default])]):
        if "capacity" not in r:
            r["capacity"] = capacity(sim, c, a.slo_attainment, lo, hi)
    print(f"\n{'rank':>4}  {'goodput':>8}  {'attain':>6}  {'P99 TTFT':>9}  {'P99 TPOT':>8}  "
          f"{'capacity':>8}  configuration")
    for c, r in shown:
        cap = r.get("capacity")
        print(f"{rank[c]:>4}  {r['goodput']:>8.3f}  {r['attainment']:>6.1%}  "
              f"{r['p99_ttft_ms']:>9.1f}  {r['p99_tpot_ms']:>8.1f}  "
              f"{'-' if cap is None and 'capacity' not in r else _fmt(cap):>8}  "
              f"{c.describe()}{'  (defaults)' if c == default else ''}")
    print("\ngoodput by token budget (each budget's best configuration):")
    gold = goldilocks(rows)
    best_budget = rows[0][0].max_num_batched_tokens  # the pick's: a budget of the most goodput
    for b, r in gold:
        print(f"  {b:>6}: goodput {r['goodput']:.3f} req/s, attainment {r['attainment']:.1%}, "
              f"P99 TTFT {r['p99_ttft_ms']:.0f} ms, P99 TPOT {r['p99_tpot_ms']:.1f} ms"
              + ("   <- goldilocks" if b == best_budget else ""))
    pick = rows[0][0]
    print(f"\npick: {pick.layout.describe() + ', each ' if pick.layout else ''}"
          f"{' '.join(pick.serve_flags())}"
          + ("  (the defaults)" if pick == default else ""))
    result: dict[str, Any] = {
        "rate": rate, "slo_ms": sim.slos, "slo_attainment": a.slo_attainment,
        "simulation": sim.describe(where=where), "goldilocks_budget": best_budget,
        "ranked": [{"rank": rank[c], **r, "defaults": c == default} for c, r in rows]}
    if a.verify:
        picks = distinct(rows, a.verify)
        if default not in dict(picks):
            picks.append((default, by_cand[default]))
        out_dir = tempfile.mkdtemp(prefix="sloserve-tune-")
        checked = verify(a, argv, picks, rate, out_dir)
        print(f"\npredicted vs measured ({a.verify_runs} run(s) each, median; raw results in "
              f"{out_dir}):")
        print(f"{'rank':>4}  {'goodput pred':>12}  {'measured':>8}  {'error':>6}  "
              f"{'attain pred':>11}  {'measured':>8}  configuration")
        for (c, _), r in zip(picks, checked):
            mg, ma = r["measured_goodput"], r["measured_attainment"]
            err = (r["goodput"] - mg) / mg if mg else float("nan")
            print(f"{rank[c]:>4}  {r['goodput']:>12.3f}  {_fmt(mg, 3):>8}  "
                  f"{err:>6.0%}  {r['attainment']:>11.1%}  "
                  f"{'-' if ma is None else f'{ma:.1%}':>8}  "
                  f"{c.describe()}{'  (defaults)' if c == default else ''}")
        result["verified"] = checked
    if a.save_tune:
        with open(a.save_tune, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"tune: {a.save_tune}", file=sys.stderr)
    return 0
