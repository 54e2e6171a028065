"""The token-count crossovers of a model's linear layers (:class:`~sloserve.model.layers.linear.
LinearPolicy`), measured at start-up on this CPU by racing layer 0's MLP weights.

A measured crossover is kept in ``~/.cache/sloserve/crossovers.json`` (``$SLOSERVE_CROSSOVER_CACHE``
names another file; ``off`` measures every time) under a key of everything it depends on: the
CPU (family, model, name, flags), the threads, the kernels' variant, torch's version, the layer's
shape and weight formats, the activations and dtype, and the sizes raced. The race at a 1B
shape takes ~20 s where the quantized product wins up to 2,048 tokens; a second start reads it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time

import torch

from sloserve.model.layers.linear import onednn_linear


def quant_crossover(model, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192,
                                  256, 384, 512, 768, 1024, 1536, 2048),
                    repeats: int = 7, max_tokens: int | None = None, prepare=None) -> int:
    """The most tokens at which the quantized product of layer 0's gate/up and down weights is
    still faster than the dense one (as the dense method serves it, AMX included) here (~50 ms
    at start-up where the dense GEMM wins above 32 tokens, ~1 s where the quantized one wins up
    to 2,048). The sizes go past a decode batch: on an AVX512-VNNI CPU without AMX the int8
    product can beat oneDNN's bf16 GEMM at prefill sizes too. With ``max_tokens`` (the most
    tokens a step will have) the sizes stop there, that size included. ``prepare()`` runs
    before a race (not when the crossover is read from the cache): it makes the dense
    weights the race needs."""
    if max_tokens is not None and max_tokens <= sizes[-1]:
        sizes = (*(s for s in sizes if s < max_tokens), max_tokens)
    mlp = model.model.layers[0].mlp
    gu, down, act = mlp.gate_up_proj, mlp.down_proj, mlp.act_fn
    key = _key("quant", model, sizes, gu.quant_method.describe(), down.quant_method.describe(),
               gu.method.amx_swiglu is not None, str(gu.weight.dtype))

    def quant(x, xf):
        gu.quant_method.swiglu(gu, x, act)
        down.quant_method.apply(down, xf)

    def dense(x, xf):
        gu.method.swiglu(gu, x, act, torch.float32)
        down.method.apply(down, xf, torch.float32)

    def measure() -> int:
        if prepare is not None:
            prepare()
        return _crossover(model.config, sizes, quant, dense, repeats)
    return _cached(key, measure)


def amx_crossover(model, sizes=(32, 64, 96, 128, 192, 256, 320, 384, 512, 768, 1024, 1536,
                                2048), repeats: int = 7) -> int:
    """The most tokens at which the AMX GEMM of layer 0's gate/up and down weights is still
    faster than torch's matmul (oneDNN, rows padded as :func:`onednn_linear` pads them) here
    (~0.5-1 s at start-up). Sizes below the first are AMX's when it wins there. The sizes go
    past the default 512-token step: a step of a decode and a 512-token chunk is one of the
    steps this decides."""
    mlp = model.model.layers[0].mlp
    gu, down, act = mlp.gate_up_proj, mlp.down_proj, mlp.act_fn
    k = gu.method.k
    dtype = gu.weight.dtype

    def amx(x, xf):
        k.amx_swiglu(x, gu.method.amx_swiglu)
        k.amx_linear(xf, down.method.amx)

    def dense(x, xf):
        act(onednn_linear(x, gu.weight, dtype))
        onednn_linear(xf, down.weight)
    return _cached(_key("amx", model, sizes, str(dtype)),
                   lambda: _crossover(model.config, sizes, amx, dense, repeats))


def cache_path() -> str | None:
    """Where measured crossovers are kept (None: ``$SLOSERVE_CROSSOVER_CACHE=off``)."""
    p = os.environ.get("SLOSERVE_CROSSOVER_CACHE", "")
    if p.lower() in ("off", "0", "none"):
        return None
    return os.path.expanduser(p) if p else os.path.join(os.path.expanduser("~"), ".cache",
                                                         "sloserve", "crossovers.json")


def _cpu_id() -> str:
    """The first processor's vendor, family, model, name and flags in /proc/cpuinfo (a model
    name alone, e.g. "AMD EPYC", names several generations)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        pass
    parts = [fields.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name")]
    return "/".join(parts) + "/" + hashlib.sha1(fields.get("flags", "").encode()).hexdigest()[:12]


def _key(kind: str, model, sizes, *extra) -> str:
    from sloserve import kernels
    c = model.config
    k = model.kernels
    return "|".join(map(str, (kind, _cpu_id(), torch.get_num_threads(),
                              getattr(k, "variant", None), torch.__version__,
                              os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                              f"{c.hidden_size}x{c.intermediate_size}", *extra,
                              ",".join(map(str, sizes)), kernels.__name__)))


#: where the last crossover came from: "measured" or the cache file it was read from
last_source = "measured"


def _read(path: str) -> dict:
    """The cache's entries; {} for a missing, damaged or non-regular file (a FIFO would
    block the open)."""
    try:
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cached(key: str, measure) -> int:
    """The crossover kept under ``key``, else ``measure()``'s, then kept (read again and
    written under an exclusive lock, so that servers starting together keep each other's
    entries)."""
    global last_source
    last_source = "measured"
    path = cache_path()
    if path is None:
        return measure()
    value = _read(path).get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        last_source = path
        return value
    value = measure()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read(path)
            data[key] = value
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError:  # a read-only home, a directory in the way: measured again next time
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return value


def _crossover(config, sizes, first, second, repeats: int) -> int:
    """The largest of ``sizes`` (rows) at which ``first(x, xf)`` (x [rows, hidden], xf [rows,
    intermediate]) runs faster than ``second``, their runs alternated (best of ``repeats``
    each, so that a burst of load on a shared machine hits both; after 2 each where one is
    1.3x faster than the other); 0 if none. Stops after two sizes in a row that ``first``
    loses."""
    best_m, losses = 0, 0
    for m in sizes:
        x = torch.randn(m, config.hidden_size)
        xf = torch.randn(m, config.intermediate_size)
        first(x, xf)
        second(x, xf)
        ta = tb = float("inf")
        for i in range(repeats):
            t0 = time.perf_counter()
            first(x, xf)
            t1 = time.perf_counter()
            second(x, xf)
            ta, tb = min(ta, t1 - t0), min(tb, time.perf_counter() - t1)
            if i >= 1 and max(ta, tb) > 1.3 * min(ta, tb):
                break
        if ta < tb:
            best_m, losses = m, 0
        else:
            losses += 1
            if losses == 2:
                break
    return best_m
