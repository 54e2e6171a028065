"""The per-request SLO: one syntax (``--goodput ttft:MS tpot:MS [e2el:MS]``, vLLM's bench
flag) and one rule, for ``sloserve bench``, ``sim``, ``tune`` and the server's SLO counters.

A request meets the SLO when its TTFT, TPOT (vLLM's definition, ``sloserve.latency.tpot``;
a request of one output token has no TPOT and meets any TPOT limit) and end-to-end latency are
each at or under their limit; only the limits given are checked. Plain Python, no clock.
"""
from __future__ import annotations

from typing import Iterable

#: the metrics an SLO may limit, in the order a miss is attributed (the first one missed)
SLO_METRICS = ("ttft", "tpot", "e2el")

SLO_HELP = ("per-request SLO limits in ms, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el; "
            "a request meets the SLO when it is within every limit given)")


def add_goodput_arg(p, extra_help: str = "") -> None:
    """``--goodput NAME:MS ...`` on an argparse parser or group (parsed by
    :func:`parse_goodput`)."""
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help=SLO_HELP + extra_help)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms).

    Raises:
        ValueError: an item without ``:``, an unknown metric (allowed: ttft, tpot, e2el) or a
            limit that is not a number > 0.
    """
    out: dict[str, float] = {}
    for item in items:
        name, sep, val = item.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO must look like NAME:MS (e.g. ttft:500), got {item!r}")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput SLO metric must be ttft, tpot or e2el, got {name!r}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"goodput SLO for {name} must be a number of ms, got {val!r}") from None
        if not ms > 0 or ms == float("inf"):
            raise ValueError(f"goodput SLO for {name} must be a finite number of ms > 0, got {val!r}")
        out[name] = ms
    return out


def missed_slo(slos: dict[str, float], ttft_s: float, tpot_s: float | None,
               e2el_s: float) -> str | None:
    """The first metric (in ``SLO_METRICS`` order) over its limit in ``slos`` (ms), or None when
    the request meets them all. Times in seconds; ``tpot_s`` None (one output token) meets."""
    values = {"ttft": ttft_s, "tpot": 0.0 if tpot_s is None else tpot_s, "e2el": e2el_s}
    for name in SLO_METRICS:
        if name in slos and values[name] * 1e3 > slos[name]:
            return name
    return None
