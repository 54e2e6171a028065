"""``--speculative-config``: vLLM's JSON, checked once (plain data; no torch).

Keys, as vLLM spells them:

* ``method``: ``ngram`` (prompt lookup: what followed an earlier occurrence of the longest
  matching suffix n-gram of prompt + output).
* ``num_speculative_tokens`` (k, required): most draft tokens per request and step.
* ``prompt_lookup_min`` (default 1), ``prompt_lookup_max`` (required for ``ngram``): the
  n-gram lengths tried, longest first.

Other methods vLLM has are refused with a message that names the ones served here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

METHODS = ("ngram",)
#: most draft tokens per request and step (vLLM's GPU kernels stop at 32 too)
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int | None = None

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the JSON text, a dict or an instance (None stays None). Raises ValueError
        naming the key, its value and what is allowed."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, "
                             f"got {method!r}")
        k = value.get("num_speculative_tokens")
        if not _int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = value.get("prompt_lookup_min", 1), value.get("prompt_lookup_max")
        if hi is None:
            raise ValueError("speculative_config: method ngram needs prompt_lookup_max (the "
                             "longest n-gram to match, e.g. 4)")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _int(v) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is over "
                             f"prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def describe(self) -> str:
        return (f"speculative decoding: {self.method}, k={self.num_speculative_tokens}, "
                f"n-grams {self.prompt_lookup_min}..{self.prompt_lookup_max}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
