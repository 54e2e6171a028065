"""Reading JSON files and JSON-lines files (bench traces, engine step traces) with errors that
name the file (and the line)."""
from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def read_jsonl(path: str, parse: Callable[[dict[str, Any]], T], what: str) -> list[T]:
    """``parse(obj)`` for every non-blank line of ``path``, each line a JSON object.

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``{path}:{line}: bad {what} (...)`` for a line that is not a JSON object or
            that ``parse`` rejects (with ValueError, KeyError or TypeError).
    """
    out: list[T] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("not a JSON object")
                out.append(parse(d))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad {what} ({e})") from None
    return out


def read_json(path: str) -> Any:
    """The JSON value in ``path``.

    Raises:
        FileNotFoundError / OSError: unreadable file.
        ValueError: ``{path}: not valid JSON (...)``.
    """
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
