"""Compare two lm-evaluation-harness runs sample by sample (``--log_samples`` output folders),
or one run against the stored reference (``reference_hf.json``, written with ``--save``).

    python benchmarks/lm_eval/compare.py RUN_DIR [REFERENCE_DIR_OR_JSON] [--save OUT.json]

Loglikelihood tasks: per (doc, choice) |loglikelihood difference| and the is-greedy flags;
generate_until tasks: identical generations. Prints one line per task and exits 1 when a
loglikelihood differs by more than --tol (default 1e-3) or a generation or flag differs.
Only the docs present in both are compared (a run with ``--limit`` checks a prefix).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

TASKS = ("sloserve_mc", "sloserve_gen")


def load_run(path: str) -> dict:
    """{task: {doc_id: resps}} from a folder of samples_<task>_*.jsonl, or a saved JSON."""
    if path.endswith(".json"):
        with open(path) as f:
            return {t: {int(k): v for k, v in d.items()} for t, d in json.load(f).items()}
    out = {}
    for task in TASKS:
        files = sorted(glob.glob(os.path.join(path, "**", f"samples_{task}_*.jsonl"),
                                 recursive=True))
        if files:
            with open(files[-1]) as f:
                out[task] = {(d := json.loads(ln))["doc_id"]: d["resps"] for ln in f}
    return out


def compare(run: dict, ref: dict, tol: float) -> list[str]:
    """One line per task; lines starting with FAIL mean a mismatch."""
    lines = []
    for task in TASKS:
        a, b = run.get(task, {}), ref.get(task, {})
        docs = sorted(set(a) & set(b))
        if not docs:
            lines.append(f"FAIL {task}: no common samples")
            continue
        if task == "sloserve_mc":
            diffs, flags = [], 0
            for d in docs:
                for (x,), (y,) in zip(a[d], b[d]):
                    diffs.append(abs(float(x[0]) - float(y[0])))
                    flags += bool(x[1]) != bool(y[1])
            bad = max(diffs) > tol or flags
            lines.append(f"{'FAIL' if bad else 'ok'} {task}: {len(docs)} docs, {len(diffs)} "
                         f"loglikelihoods, max |diff| {max(diffs):.2e} (tol {tol:g}), "
                         f"{flags} is-greedy flags differ")
        else:
            same = sum(a[d] == b[d] for d in docs)
            lines.append(f"{'ok' if same == len(docs) else 'FAIL'} {task}: {same}/{len(docs)} "
                         f"generations identical")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("reference", nargs="?",
                   default=os.path.join(os.path.dirname(__file__), "reference_hf.json"))
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--save", help="write RUN as a reference JSON here and exit")
    a = p.parse_args()
    run = load_run(a.run)
    if a.save:
        with open(a.save, "w") as f:
            json.dump(run, f, indent=0)
        return 0
    lines = compare(run, load_run(a.reference), a.tol)
    print("\n".join(lines))
    return 1 if any(ln.startswith("FAIL") for ln in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
