"""Where does ``sloserve tune``'s pick beat the engine's defaults? An SLO x request-rate sweep of
``sloserve tune`` (simulated only, no --verify) on one workload and cost model, tabulating the
pick's predicted goodput against the defaults'.

    python benchmarks/tune_sweep.py --profile results/tune_2026-12-06/profile.json \
        --rates 1.5,3,4.5 --slos "ttft:800 tpot:25" "ttft:500 tpot:15" \
        --out results/tune_2026-12-07/sweep.json -- --dataset-name mixed --mixed-scale 0.25 \
        --num-prompts 60

Everything after ``--`` goes to ``sloserve tune`` as given (the workload flags). Prints one row
per (SLO, rate): the pick, its predicted goodput and the defaults', their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="the cost model (sloserve profile --out)")
    p.add_argument("--rates", required=True, help="request rates, comma-separated (req/s)")
    p.add_argument("--slos", nargs="+", required=True,
                   help='SLOs, each one quoted --goodput value ("ttft:MS tpot:MS")')
    p.add_argument("--out", required=True, help="JSON file for the table")
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    rows = []
    print(f"{'SLO':<24} {'rate':>5}  {'pick goodput':>12}  {'defaults':>8}  {'ratio':>5}  pick")
    for slo in a.slos:
        for rate in (float(r) for r in a.rates.split(",")):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                path = f.name
            cmd = [sys.executable, "-m", "sloserve.cli", "tune", "--profile", a.profile,
                   "--request-rate", f"{rate:g}", "--goodput", *slo.split(),
                   "--capacity-top", "0", "--top", "1", "--save-tune", path, *rest]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(path) as f:
                res = json.load(f)
            os.unlink(path)
            ranked = res["ranked"]
            pick = ranked[0]
            default = next(r for r in ranked if r.get("defaults"))
            ratio = pick["goodput"] / default["goodput"] if default["goodput"] else float("inf")
            rows.append({"slo": slo, "rate": rate, "pick": pick["config"],
                         "pick_goodput": pick["goodput"], "pick_attainment": pick["attainment"],
                         "defaults_goodput": default["goodput"],
                         "defaults_attainment": default["attainment"],
                         "defaults_rank": default["rank"], "ratio": ratio})
            print(f"{slo:<24} {rate:>5g}  {pick['goodput']:>12.3f}  {default['goodput']:>8.3f}  "
                  f"{ratio:>5.2f}  {pick['config']}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/tune_sweep.py", *argv]),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
