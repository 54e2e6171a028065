"""Workload and arrival flags shared by ``sloserve bench``, ``bench sweep`` and (later) ``sim``."""
from __future__ import annotations

import argparse
import os

from sloserve.argtypes import int_list as _ints
from sloserve.argtypes import pos_float as _pos_float
from sloserve.argtypes import nonneg_int as _nonneg_int, pos_int as _pos_int
from sloserve.argtypes import rate as _rate
from sloserve.bench.datasets import (WORKLOADS, PromptFactory, mixed_workload, random_workload,
                                     shared_prefix_workload, sharegpt_workload, trace_workload,
                                     copy_workload)
from sloserve.workload import SampleRequest


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Dataset flags (vLLM's spelling where it has one)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=WORKLOADS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or trace JSONL file")
    g.add_argument("--num-prompts", type=_pos_int, default=100)
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    g.add_argument("--random-input-len", type=_pos_int, default=1024)
    g.add_argument("--random-output-len", type=_pos_int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=_nonneg_int, default=0,
                   help="tokens of one random prefix that every random prompt starts with")
    g.add_argument("--mixed-short-lens", type=_ints, default=[128, 256, 512])
    g.add_argument("--mixed-long-lens", type=_ints, default=[2048, 4096])
    g.add_argument("--mixed-long-fraction", type=float, default=0.2)
    g.add_argument("--mixed-output-len-range", type=_ints, default=[30, 80], metavar="LO,HI")
    g.add_argument("--mixed-scale", type=_pos_float, default=1.0,
                   help="multiplies every mixed prompt length (fit the model and machine)")
    g.add_argument("--prefix-num-groups", type=_pos_int, default=4)
    g.add_argument("--prefix-len", type=_pos_int, default=1024)
    g.add_argument("--prefix-suffix-len", type=_pos_int, default=64)
    g.add_argument("--prefix-output-len", type=_pos_int, default=64)
    g.add_argument("--sharegpt-output-len", type=_pos_int, default=None)
    g.add_argument("--trace-time-scale", type=_pos_float, default=1.0)
    g.add_argument("--copy-output-extra", type=_nonneg_int, default=16,
                   help="copy: max_tokens is the passage's tokens plus this many")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="mean requests/s; inf sends all at once")
    a.add_argument("--burstiness", type=_pos_float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    a.add_argument("--arrival", choices=["poisson", "gamma", "constant"], default=None,
                   help="default: poisson, or gamma when --burstiness != 1")
    a.add_argument("--max-concurrency", type=_pos_int, default=None)


def check_workload_flags(a: argparse.Namespace) -> None:
    """Validate the workload flags that need no tokenizer or server. Raises ValueError."""
    if not 0 <= a.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {a.random_range_ratio}")
    if not 0 <= a.mixed_long_fraction <= 1:
        raise ValueError(f"--mixed-long-fraction must be in [0, 1], got {a.mixed_long_fraction}")
    lo_hi = a.mixed_output_len_range
    if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
        raise ValueError(f"--mixed-output-len-range takes LO,HI with LO <= HI, got {lo_hi}")
    if a.dataset_name in ("sharegpt", "trace"):
        if not a.dataset_path:
            raise ValueError(f"--dataset-name {a.dataset_name} needs --dataset-path")
        if not os.path.isfile(a.dataset_path):
            raise FileNotFoundError(f"--dataset-path {a.dataset_path!r} is not a file")


def arrival_process(a: argparse.Namespace) -> str:
    """The arrival process named by the flags."""
    return a.arrival or ("poisson" if a.burstiness == 1.0 else "gamma")


def build_workload(a: argparse.Namespace, factory: PromptFactory) -> list[SampleRequest]:
    """The workload named by the flags.

    Raises:
        ValueError: bad combination (e.g. sharegpt without --dataset-path).
    """
    name, n, seed = a.dataset_name, a.num_prompts, a.seed
    if name == "random":
        return random_workload(factory, n, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, seed, a.random_prefix_len)
    if name == "mixed":
        lo_hi = a.mixed_output_len_range
        if len(lo_hi) != 2:
            raise ValueError(f"--mixed-output-len-range takes LO,HI, got {lo_hi}")
        return mixed_workload(factory, n, short_lens=a.mixed_short_lens, long_lens=a.mixed_long_lens,
                              long_fraction=a.mixed_long_fraction, output_range=(lo_hi[0], lo_hi[1]),
                              scale=a.mixed_scale, seed=seed)
    if name == "shared-prefix":
        return shared_prefix_workload(factory, n, num_groups=a.prefix_num_groups,
                                      prefix_len=a.prefix_len, suffix_len=a.prefix_suffix_len,
                                      output_len=a.prefix_output_len, seed=seed)
    if name == "copy":
        return copy_workload(factory, n, output_extra=a.copy_output_extra, seed=seed)
    if not a.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "sharegpt":
        return sharegpt_workload(a.dataset_path, factory.tok, n, output_len=a.sharegpt_output_len,
                                 seed=seed)
    return trace_workload(a.dataset_path, factory, n, time_scale=a.trace_time_scale)
