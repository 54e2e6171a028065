"""Benchmark workloads: what each request sends. All seeded and reproducible.

* ``random``: input / output lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
  (r = ``range_ratio``, as in ``vllm bench serve --random-range-ratio``), optionally after one
  shared prefix (``--random-prefix-len``, as vLLM's).
* ``mixed``: mostly short prompts and a fraction of long ones, the mix in which an unchunked
  prefill stalls the running decodes (default: 80 % of 128/256/512 tokens, 20 % of 2048/4096,
  outputs 30-80 tokens; ``scale`` multiplies every prompt length).
* ``shared-prefix``: groups of requests that share one long prefix (for prefix caching).
* ``sharegpt``: a ShareGPT-format JSON file (first human turn = prompt, first reply = its
  length), filtered as vLLM does: prompt or output < 4 tokens, prompt > 1024 or
  prompt + output > 2048 tokens dropped.
* ``trace``: JSONL lines of arrival time, input length and output length, replayed.
* ``copy``: prompts that ask to repeat a passage or lightly edit it (the passages ship in
  ``sloserve/bench/copy_passages.py``), ``max_tokens`` the passage's length plus
  ``--copy-output-extra``: the copy-heavy work where n-gram drafts pay.

Prompts of an exact token length are built from the tokenizer the server uses: random
space-prefixed word tokens, decoded to text and re-encoded until the count is exact.
"""
from __future__ import annotations

import math
import random
import re
from typing import Any, Protocol, Sequence

import numpy as np

from sloserve.jsonl import read_json, read_jsonl
from sloserve.workload import PREFIX_GROUP_TAG, SampleRequest

WORKLOADS = ("random", "mixed", "shared-prefix", "sharegpt", "trace", "copy")


class TokenizerLike(Protocol):
    """What the workloads need of a tokenizer (sloserve's ``Tokenizer`` fits)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class PromptFactory:
    """Builds prompt texts of an exact token count for one tokenizer.

    The text is a sequence of random whole-word tokens (decoded tokens matching ``" [a-z]+"``),
    which re-tokenize stably; the few that merge at a boundary are fixed by trimming or padding
    the re-encoded ids and trying again.
    """

    _WORD = re.compile(r"^ [a-z]{2,12}$")

    def __init__(self, tokenizer: TokenizerLike, seed: int = 0):
        """Scan the vocabulary for word tokens.

        Raises:
            ValueError: the tokenizer has fewer than 100 such tokens.
        """
        self.tok = tokenizer
        self.rng = random.Random(seed)
        n = len(tokenizer) if hasattr(tokenizer, "__len__") else 32000
        hf = getattr(tokenizer, "hf", None)
        if hf is not None and hasattr(hf, "batch_decode"):
            texts = hf.batch_decode([[i] for i in range(n)])
        else:
            texts = [tokenizer.decode([i]) for i in range(n)]
        self.words = [i for i, t in enumerate(texts) if self._WORD.match(t)]
        if len(self.words) < 100:
            raise ValueError(f"tokenizer has only {len(self.words)} whole-word tokens; "
                             "cannot build random prompts with it")

    def count(self, text: str) -> int:
        """Tokens in ``text`` without special tokens."""
        return len(self.tok.encode(text, add_special_tokens=False))

    def make(self, num_tokens: int) -> tuple[str, int]:
        """A random text of ``num_tokens`` tokens (or within a token of it, rarely).

        Returns:
            (text, its exact token count).

        Raises:
            ValueError: num_tokens < 1.
        """
        if num_tokens < 1:
            raise ValueError(f"prompt length must be >= 1 token, got {num_tokens}")
        ids = [self.rng.choice(self.words) for _ in range(num_tokens)]
        text = ""
        for _ in range(20):
            text = self.tok.decode(ids)
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                return text, num_tokens
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids = ids + [self.rng.choice(self.words) for _ in range(num_tokens - len(ids))]
        return text, self.count(text)


def _uniform_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_workload(factory: PromptFactory, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0,
                    prefix_len: int = 0) -> list[SampleRequest]:
    """``num_prompts`` random prompts; lengths uniform in [len*(1-r), len*(1+r)] tokens, after
    one random prefix of ``prefix_len`` tokens that every prompt starts with (``vllm bench
    serve --random-prefix-len``: a prompt is ``prefix_len`` + its drawn length tokens).

    Raises:
        ValueError: range_ratio outside [0, 1), lengths < 1, prefix_len < 0.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input and output lengths must be >= 1, got {input_len}, {output_len}")
    if prefix_len < 0:
        raise ValueError(f"prefix length must be >= 0 tokens, got {prefix_len}")
    rng = np.random.default_rng(seed)
    ins = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    outs = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = factory.make(prefix_len)[0] if prefix_len else ""
    reqs = []
    for i, o in zip(ins, outs):
        text, n = factory.make(i)
        if prefix:  # word tokens start with a space: the two parts keep their own tokens
            text = prefix + text
            n = factory.count(text)
        reqs.append(SampleRequest(text, n, o))
    return reqs


def mixed_workload(factory: PromptFactory, num_prompts: int, *,
                   short_lens: Sequence[int] = (128, 256, 512), long_lens: Sequence[int] = (2048, 4096),
                   long_fraction: float = 0.2, output_range: tuple[int, int] = (30, 80),
                   scale: float = 1.0, seed: int = 0) -> list[SampleRequest]:
    """Short and long prompts mixed: exactly round(long_fraction * n) long ones, at random places.

    Args:
        short_lens / long_lens: prompt lengths (tokens, before ``scale``) drawn uniformly.
        long_fraction: share of long prompts in [0, 1].
        output_range: inclusive range of output lengths (tokens).
        scale: multiplies every prompt length (to fit a small model or a slow machine).

    Raises:
        ValueError: fraction outside [0, 1], scale <= 0, empty length lists, bad output range.
    """
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long fraction must be in [0, 1], got {long_fraction}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not short_lens or not long_lens:
        raise ValueError("short and long length lists must not be empty")
    lo, hi = output_range
    if not 1 <= lo <= hi:
        raise ValueError(f"output range must be 1 <= lo <= hi, got {output_range}")
    rng = np.random.default_rng(seed)
    n_long = round(long_fraction * num_prompts)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[rng.permutation(num_prompts)[:n_long]] = True
    reqs = []
    for long_ in is_long:
        base = int(rng.choice(long_lens if long_ else short_lens))
        out = int(rng.integers(lo, hi + 1))
        text, n = factory.make(max(1, round(base * scale)))
        reqs.append(SampleRequest(text, n, out, tag="long" if long_ else "short"))
    return reqs


def shared_prefix_workload(factory: PromptFactory, num_prompts: int, *, num_groups: int = 4,
                           prefix_len: int = 1024, suffix_len: int = 64, output_len: int = 64,
                           seed: int = 0) -> list[SampleRequest]:
    """``num_groups`` prefixes of ``prefix_len`` tokens; request i gets prefix i % groups plus its
    own ``suffix_len``-token suffix; requests are shuffled (seeded) so groups interleave.

    Raises:
        ValueError: num_groups < 1 or lengths < 1.
    """
    if num_groups < 1:
        raise ValueError(f"number of prefix groups must be >= 1, got {num_groups}")
    prefixes = [factory.make(prefix_len)[0] for _ in range(num_groups)]
    reqs = []
    for i in range(num_prompts):
        text = prefixes[i % num_groups] + factory.make(suffix_len)[0]
        reqs.append(SampleRequest(text, factory.count(text), output_len, tag=f"{PREFIX_GROUP_TAG}{i % num_groups}"))
    random.Random(seed).shuffle(reqs)
    return reqs


def copy_workload(factory: PromptFactory, num_prompts: int, *, output_extra: int = 16,
                  seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` requests, each a passage and an instruction (seeded choice, every
    passage used before one repeats); ``max_tokens`` = the passage's tokens + ``output_extra``."""
    from sloserve.bench.copy_passages import INSTRUCTIONS, PASSAGES
    rng = random.Random(seed)
    order: list[int] = []
    reqs = []
    for _ in range(num_prompts):
        if not order:
            order = list(range(len(PASSAGES)))
            rng.shuffle(order)
        passage = PASSAGES[order.pop()]
        text = rng.choice(INSTRUCTIONS).format(passage=passage)
        reqs.append(SampleRequest(text, factory.count(text),
                                  factory.count(passage) + output_extra, tag="copy"))
    return reqs


def sharegpt_workload(path: str, tokenizer: TokenizerLike, num_prompts: int, *,
                      output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """Requests from a ShareGPT JSON file (a list of ``{"conversations": [{"from", "value"}, ...]}``).

    Conversations with fewer than two turns (or turns that are not objects) are skipped; the prompt is the first turn and the
    output length the token count of the second (or ``output_len``). Pairs with a prompt or
    output under 4 tokens, a prompt over 1024 or a total over 2048 tokens are dropped.

    Raises:
        FileNotFoundError, ValueError: unreadable file, not a list, or fewer usable conversations
            than ``num_prompts``.
    """
    data = read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    convs = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    convs = [c for c in convs if isinstance(c, list) and len(c) >= 2
             and isinstance(c[0], dict) and isinstance(c[1], dict)]
    random.Random(seed).shuffle(convs)
    reqs: list[SampleRequest] = []
    for c in convs:
        if len(reqs) == num_prompts:
            break
        prompt, completion = str(c[0].get("value", "")), str(c[1].get("value", ""))
        p = len(tokenizer.encode(prompt, add_special_tokens=False))
        o = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if p < 4 or o < 4 or p > 1024 or p + o > 2048:
            continue
        reqs.append(SampleRequest(prompt, p, o))
    if len(reqs) < num_prompts:
        raise ValueError(f"{path}: only {len(reqs)} usable conversations, {num_prompts} requested")
    return reqs


def _field(d: dict[str, Any], *names: str) -> Any:
    for n in names:
        if n in d:
            return d[n]
    raise KeyError(f"none of {names}")


def _length(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"lengths must be integers >= 1, got {v!r}")
    return v


def trace_workload(path: str, factory: PromptFactory, num_prompts: int | None = None, *,
                   time_scale: float = 1.0) -> list[SampleRequest]:
    """Replay a JSONL trace: one object per line with the arrival time (``arrival_time`` in s, or
    ``timestamp`` in ms as in the Mooncake traces), ``input_len``/``input_length`` and
    ``output_len``/``output_length``, and optionally ``priority`` (an integer, vLLM's request
    field: lower runs first under ``--scheduling-policy priority``; default 0). Arrival times
    are shifted to start at 0 and multiplied by ``time_scale``; prompts are random texts of the
    given lengths.

    Raises:
        ValueError: a line that is not JSON or lacks a field (the message gives the line number).
    """
    def parse(d: dict[str, Any]) -> tuple[float, int, int, int]:
        t = float(d["arrival_time"]) if "arrival_time" in d else float(d["timestamp"]) / 1e3
        if not math.isfinite(t):
            raise ValueError(f"arrival time must be finite, got {t}")
        prio = d.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int) or not -2**63 <= prio < 2**63:
            raise ValueError(f"priority must be an integer in [-2**63, 2**63), got {prio!r}")
        return (t, _length(_field(d, "input_len", "input_length")),
                _length(_field(d, "output_len", "output_length")), prio)
    rows = read_jsonl(path, parse, "trace line")
    rows.sort()
    rows = rows[:num_prompts] if num_prompts else rows
    t0 = rows[0][0] if rows else 0.0
    reqs = []
    for t, i, o, prio in rows:
        text, n = factory.make(i)
        reqs.append(SampleRequest(text, n, o, arrival_time=(t - t0) * time_scale, priority=prio))
    return reqs
