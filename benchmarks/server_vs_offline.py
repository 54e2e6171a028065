"""Throughput through the server vs the same engine offline (issue 10's bar: >= 90 %).

The same 48 prompts (the bench's seeded ``random`` workload, 256 in / 64 out, greedy,
``ignore_eos``) run (1) through ``LLM.generate`` in one process and (2) through ``sloserve serve``
driven by ``sloserve bench --max-concurrency 16``, with the same engine flags. ``--max-num-seqs``
defaults to the concurrency, so both run batches of at most 16 (offline would otherwise batch all
48 at once). Output tokens/s of each and the ratio are printed and optionally saved.

    .venv/bin/python benchmarks/server_vs_offline.py [--rounds 2] [--out FILE.json]
        [--sloserve-path DIR]   # another checkout's code for the engine and the server
        [--server-arg=--num-threads=1 ...]

``--sloserve-path`` runs the engine (offline and served) from another checkout (PYTHONPATH, and
that checkout as the working directory, which ``python -m`` puts first on sys.path, ahead of this
checkout's editable install), with this checkout's bench client, so a before/after pair is
measured the same way.
The rounds alternate offline and served runs; the machine is noisy, so compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OFFLINE = r"""
import json, sys, time
from sloserve import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(**spec["engine"])
sp = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
llm.generate(spec["prompts"][:2], sp)  # warm-up
t0 = time.perf_counter()
outs = llm.generate(spec["prompts"], sp)
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "output_tokens": sum(o.num_output_tokens for o in outs)}))
"""


def _env(path: str | None, extra: list[str] = ()) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(kv.split("=", 1) for kv in extra)
    if path:
        env["PYTHONPATH"] = os.path.abspath(path) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def workload(n: int, input_len: int, output_len: int, seed: int) -> list[str]:
    from sloserve.bench.datasets import PromptFactory, random_workload
    from sloserve.bench.tokenizer import load_tokenizer
    from sloserve.embedded import default_model_path
    reqs = random_workload(PromptFactory(load_tokenizer(default_model_path()), seed=seed), n,
                           input_len, output_len, 0.0, seed)
    return [r.prompt for r in reqs]


def offline(prompts, output_len, engine: dict, path: str | None) -> float:
    spec = {"prompts": prompts, "output_len": output_len, "engine": engine}
    r = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(spec)], env=_env(path),
                       cwd=path, capture_output=True, text=True, check=True)
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["output_tokens"] / d["wall_s"]


def served(a, server_args: list[str]) -> float:
    from sloserve.bench.server_proc import free_port, wait_healthy
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sloserve.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *server_args],
                            env=_env(a.sloserve_path, a.server_env), cwd=a.sloserve_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 300)
        name = f"bench-{port}.json"
        subprocess.run([sys.executable, "-m", "sloserve.cli", "bench", "--base-url", base,
                        "--dataset-name", "random", "--random-input-len", str(a.input_len),
                        "--random-output-len", str(a.output_len), "--num-prompts",
                        str(a.num_prompts), "--max-concurrency", str(a.concurrency),
                        "--ignore-eos", "--seed", str(a.seed), "--save-result", "--result-dir",
                        a.tmp, "--result-filename", name],
                       check=True, stdout=subprocess.DEVNULL, env=_env(None))
        with open(os.path.join(a.tmp, name)) as f:
            return json.load(f)["output_throughput"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sloserve-path", default=None)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra `sloserve serve` flag (repeat), e.g. --server-arg=--dtype=float32")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the server only (repeat)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default="/tmp")
    a = ap.parse_args()
    prompts = workload(a.num_prompts, a.input_len, a.output_len, a.seed)
    engine = {"max_num_seqs": a.concurrency}
    server_args = ["--max-num-seqs", str(a.concurrency), *a.server_arg]
    for arg in a.server_arg:  # the same flags offline
        k, _, v = arg.lstrip("-").partition("=")
        engine[k.replace("-", "_")] = int(v) if v.isdigit() else v
    rows = []
    for r in range(a.rounds):
        off = offline(prompts, a.output_len, engine, a.sloserve_path)
        srv = served(a, server_args)
        rows.append({"round": r, "offline_tok_s": off, "served_tok_s": srv, "ratio": srv / off})
        print(f"round {r}: offline {off:.1f} tok/s, served {srv:.1f} tok/s, ratio "
              f"{srv / off:.3f}", flush=True)
    res = {"when": time.strftime("%Y-%m-%d %H:%M"), "sloserve_path": a.sloserve_path or ".",
           "engine": engine, "server_args": server_args, "server_env": a.server_env,
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
