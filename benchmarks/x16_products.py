"""The x16 quantized products (``Kernels.qlinear_x16``) alone: 1 and 16 activation rows over
weights streamed from memory (GB/s of weights), 512 rows on one weight (GFLOP/s, the prefill
case), and optionally the same for a second build of the kernels, timed in alternate rounds.

    .venv/bin/python benchmarks/x16_products.py [--b-csrc DIR] [--bits 4|8] [--n 4096] [--k 4096]
        [--weights 40] [--rounds 8]

``--b-csrc DIR``: a changed copy of ``sloserve/kernels/csrc`` (same packing) built as library B (under
the kernel cache's ``b/``) beside this checkout's library A; their outputs must be equal on every
shape (else it stops), and each round times A then B or B then A in turn, so that the host's
memory bandwidth, which moves from minute to minute, falls on both alike. Weights: ``--weights``
random [N, K] matrices of the GGUF Q4_1 (``--bits 4``: codes, float16-exact scales and offsets)
or Q8_0 (``--bits 8``) kind, packed once; together far larger than the last-level cache.
Prints the median of the rounds for each figure with its range.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import sloserve.kernels
from sloserve.model.quant import QuantizedWeight, quantize_int4, quantize_int8

build_mod = sys.modules["sloserve.kernels.build"]


def libraries(b_csrc: str | None) -> dict[str, sloserve.kernels.Kernels]:
    libs = {"A": sloserve.kernels.Kernels(build_mod.build("avx512"), "avx512")}
    if b_csrc:
        csrc = os.path.abspath(b_csrc)
        old = build_mod.CSRC, build_mod.SRC, os.environ.get("SLOSERVE_KERNEL_DIR")
        build_mod.CSRC, build_mod.SRC = csrc, os.path.join(csrc, "kernels.cpp")
        os.environ["SLOSERVE_KERNEL_DIR"] = os.path.join(build_mod.kernel_dir(), "b")
        try:
            libs["B"] = sloserve.kernels.Kernels(build_mod.build("avx512"), "avx512")
        finally:
            build_mod.CSRC, build_mod.SRC = old[0], old[1]
            if old[2] is None:
                os.environ.pop("SLOSERVE_KERNEL_DIR")
            else:
                os.environ["SLOSERVE_KERNEL_DIR"] = old[2]
    return libs


def weights(k: sloserve.kernels.Kernels, bits: int, n: int, kk: int, count: int) -> list:
    base = (quantize_int4 if bits == 4 else quantize_int8)(torch.randn(n, kk), "bench")
    mins = base.mins.half().float() if base.has_mins else None
    out = []
    for i in range(count):  # distinct bytes in each, so no two share cache lines
        q = base.qweight.clone()
        q[i % n] ^= 0x11 if bits == 4 else 1
        out.append(k.pack_x16(QuantizedWeight(q, base.scales.half().float(), mins, bits, 32,
                                              base.shape, "bench")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b-csrc", default=None, help="a changed copy of sloserve/kernels/csrc")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--weights", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    libs = libraries(a.b_csrc)
    for name, k in libs.items():
        print(f"library {name}: {k.path}")
    ws = weights(libs["A"], a.bits, a.n, a.k, a.weights)
    nbytes = sum(w.nbytes for w in ws)
    print(f"{a.weights} weights {a.n} x {a.k}, {a.bits}-bit: {nbytes / 1e6:.0f} MB, "
          f"{torch.get_num_threads()} threads")
    xs = {m: torch.randn(m, a.k) for m in (1, 16, 512)}
    if "B" in libs:
        for m, x in xs.items():
            ya, yb = libs["A"].qlinear_x16(x, ws[0]), libs["B"].qlinear_x16(x, ws[0])
            if not torch.equal(ya, yb):
                sys.exit(f"A and B differ at {m} rows: max |A - B| = {float((ya - yb).abs().max())}")
        print("A and B give equal outputs at 1, 16 and 512 rows")

    def from_memory(k, x) -> float:
        t = time.perf_counter()
        for w in ws:
            k.qlinear_x16(x, w)
        return nbytes / (time.perf_counter() - t) / 1e9

    def prefill(k) -> float:
        t = time.perf_counter()
        for _ in range(3):
            k.qlinear_x16(xs[512], ws[0])
        return 3 * 2 * 512 * a.n * a.k / (time.perf_counter() - t) / 1e9

    figs = {"1 row, GB/s": lambda k: from_memory(k, xs[1]),
            "16 rows, GB/s": lambda k: from_memory(k, xs[16]),
            "512 rows, GFLOP/s": prefill}
    res = {f: {n: [] for n in libs} for f in figs}
    order = list(libs)
    for r in range(a.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            for f, fn in figs.items():
                res[f][name].append(fn(libs[name]))
    for f, d in res.items():
        cells = [f"{n} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for n, v in d.items()]
        ratio = (f"   B / A {statistics.median(d['B']) / statistics.median(d['A']):.3f}"
                 if "B" in d else "")
        print(f"{f}: " + ", ".join(cells) + ratio)


if __name__ == "__main__":
    main()
