"""Per-request sampling and stopping parameters (OpenAI / vLLM semantics)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


_GREEDY_EPS = 1e-5
#: stop strings are matched on every new token in the engine thread: bound the work per request
MAX_STOP_STRINGS, MAX_STOP_LEN = 32, 1024
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts
#: top_k above this is no different from "all tokens" (and must fit the engine's messages)
MAX_TOP_K = 2 ** 31 - 1


def child_seed(seed: int, i: int) -> int:
    """The seed of choice ``i`` of a seeded request with ``n`` > 1: ``seed + i``, wrapped into
    the accepted range."""
    span = _SEED_MAX - _SEED_MIN + 1
    return (seed + i - _SEED_MIN) % span + _SEED_MIN


class ParamError(ValueError):
    """A request parameter is out of range. `param` names the offending field (OpenAI `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def require_unicode(text: str, what: str, param: str) -> None:
    """Raise ParamError if ``text`` has a lone surrogate (valid in JSON escapes, not in UTF-8:
    it could neither cross the process boundary (msgspec) nor reach the tokenizer)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(f"{what} is not valid Unicode: {e.reason} at character {e.start}",
                         param) from None


#: longest structured-output spec (characters of a schema, regex or grammar)
MAX_STRUCTURED_SPEC = 65536


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``structured_outputs``); exactly one field is set.

    Attributes:
        json: a JSON schema (as JSON text).
        json_object: any JSON object (``response_format: {"type": "json_object"}``).
        regex: a regular expression the whole output matches.
        choice: one of these strings exactly.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, root rule ``root``).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ParamError(f"structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {', '.join(set_) or 'none'}",
                             "structured_outputs")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ParamError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings", "structured_outputs")
        key = self.key
        require_unicode(key, "structured_outputs", "structured_outputs")
        size = len(key)
        if size > MAX_STRUCTURED_SPEC:
            raise ParamError(f"structured_outputs spec has {size} characters, over the limit "
                             f"of {MAX_STRUCTURED_SPEC}", "structured_outputs")

    @property
    def kind(self) -> str:
        return ("json schema" if self.json is not None else "json object" if self.json_object
                else "regex" if self.regex is not None else "choice" if self.choice is not None
                else "grammar")

    @property
    def key(self) -> str:
        """One string per distinct spec (the compiled-grammar cache key)."""
        body = (self.json if self.json is not None else "" if self.json_object
                else self.regex if self.regex is not None
                else "\x00".join(self.choice) if self.choice is not None else self.grammar)
        return f"{self.kind}:{body}"


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        temperature: 0 (below 1e-5) means greedy (argmax); > 0 scales the logits before softmax.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) disables.
        seed: per-request RNG seed; the same seed gives the same tokens whatever the batch-mates.
        max_tokens: maximum output tokens (>= 1). None: up to the model's context length.
        stop: strings that end the output; the matched stop string is never returned.
        stop_token_ids: extra token ids that end the output (not returned as text).
        ignore_eos: keep generating past EOS (benchmarks that need fixed output lengths).
        skip_special_tokens: drop special tokens from the returned text.
        logprobs: per output token, return the sampled token's log probability and the
            ``logprobs`` most likely tokens' (0: the sampled token's only; None: nothing).
        prompt_logprobs: per prompt token after the first, its log probability and the
            ``prompt_logprobs`` most likely tokens' (None: nothing). Such a request computes its
            whole prompt: it takes no prefix-cache blocks (their logits were never kept).
        structured_outputs: constrain the output to a schema, regex, choice or grammar.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        """Raise ParamError naming the field, its value and the allowed range."""
        if self.temperature is None or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ParamError(f"temperature must be a finite number >= 0, got {self.temperature}",
                             "temperature")
        if self.top_p is None or not (0.0 < self.top_p <= 1.0):  # NaN fails this too
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        for name in ("top_k", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ParamError(f"{name} must be an integer, got {v!r}", name)
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in self.stop):
            raise ParamError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_LEN} characters, got {len(self.stop)} strings, longest "
                             f"{max(len(s) for s in self.stop)}", "stop")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2 ** 31
               for t in self.stop_token_ids):
            raise ParamError(f"stop_token_ids must be non-negative integers, got "
                             f"{self.stop_token_ids[:8]}", "stop_token_ids")
        if self.top_k < -1 or self.top_k > MAX_TOP_K:
            raise ParamError(f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}], got "
                             f"{self.top_k}", "top_k")
        for s in self.stop:
            require_unicode(s, "a stop string", "stop")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ParamError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}", "seed")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_TOP_K:
                raise ParamError(f"{name} must be >= 0, got {v}", name)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (dividing logits by them overflows; vLLM does the same)."""
        return self.temperature < _GREEDY_EPS
