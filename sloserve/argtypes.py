"""argparse ``type=`` converters shared by every ``sloserve`` subcommand: each raises
``argparse.ArgumentTypeError`` with a message that names the expected form and the value."""
from __future__ import annotations

import argparse
import math
from typing import Callable, TypeVar

T = TypeVar("T")


def _convert(v: str, kind: Callable[[str], T], what: str) -> T:
    try:
        return kind(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v!r}") from None


def int_list(v: str) -> list[int]:
    """``"128,256"`` -> ``[128, 256]``; every entry an integer >= 1."""
    out = _convert(v, lambda s: [int(x) for x in s.split(",") if x.strip()],
                   "comma-separated integers")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {v!r}")
    return out


def _int_at_least(v: str, lo: int) -> int:
    n = _convert(v, int, "an integer")
    if n < lo:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {n}")
    return n


def pos_int(v: str) -> int:
    """An integer >= 1."""
    return _int_at_least(v, 1)


def nonneg_int(v: str) -> int:
    """An integer >= 0."""
    return _int_at_least(v, 0)


def pos_float(v: str) -> float:
    """A finite number > 0."""
    x = _convert(v, float, "a number")
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {v!r}")
    return x


def rate(v: str) -> float:
    """A request rate: a number > 0 or ``inf``."""
    try:
        r = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rate must be a number or inf, got {v!r}") from None
    if not r > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {v!r}")
    return r


def port(v: str, lowest: int = 0) -> int:
    """A TCP port in [lowest, 65535] (0 = any free port, where allowed)."""
    p = _convert(v, int, "a port number")
    if not lowest <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in {lowest}-65535, got {p}")
    return p


def client_port(v: str) -> int:
    """A port to connect to: 1-65535."""
    return port(v, lowest=1)


def parse_given(parser: argparse.ArgumentParser, argv: list[str],
                defaults: dict | None = None) -> tuple[argparse.Namespace, set[str]]:
    """Parse ``argv`` once and say which options the user gave.

    Every option's default is left out of the parse (``argparse.SUPPRESS``), so what the parse
    returns is exactly what was given (no re-reading of argv, no abbreviation guessing: build
    the parser with ``allow_abbrev=False``); then ``defaults`` (e.g. a preset's settings) and
    the parser's own defaults fill the rest, in that order.

    Returns:
        (the complete namespace, the dests of the options given).
    """
    saved, types = {}, {}
    for act in parser._actions:
        if act.dest != "help" and act.option_strings:
            saved[act.dest] = act.default
            types[act.dest] = act.type
            act.default = argparse.SUPPRESS
    try:
        ns = parser.parse_args(argv)
    finally:
        for act in parser._actions:
            if act.dest in saved:
                act.default = saved[act.dest]
    given = set(vars(ns))
    for dest, value in saved.items():  # as argparse would: a string default goes through type
        if isinstance(value, str) and types[dest] is not None:
            saved[dest] = types[dest](value)
    for dest, value in {**saved, **(defaults or {})}.items():
        if dest not in given:
            setattr(ns, dest, value)
    return ns, given


#: bandwidth units: bits or bytes per second, decimal prefixes (``tc``'s and NICs' spelling)
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_bandwidth(v: "str | float | int") -> float:
    """A link rate in bytes/s: a number (bytes/s) or a number with a unit, ``0.4gbit``,
    ``100mbit``, ``50MB`` (``/s`` optional; bit units are bits, the others bytes). Raises
    ValueError naming the forms for anything else or a rate <= 0."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = float(v)
    else:
        s = str(v).strip().lower().removesuffix("/s").replace("ps", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):] or "b"
        try:
            x = float(num) * _RATE_UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(f"expected a rate such as 0.4gbit, 100mbit, 50MB/s or a number of "
                             f"bytes/s, got {v!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"a rate must be finite and > 0, got {v!r}")
    return x


def json_object(value: "str | dict", name: str) -> dict:
    """A JSON-object setting (``--speculative-config``-style flags): the text parsed, or the
    dict, as a new dict. Raises ValueError naming ``name`` for invalid JSON or a non-object."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return dict(value)
