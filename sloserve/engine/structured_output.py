"""Structured outputs: a JSON schema, JSON, a regex, a choice of strings or an EBNF grammar,
compiled with xgrammar into a per-step token mask (what vLLM and SGLang use).

The front end checks a request's spec with :func:`validate` (parsing only, no tokenizer: a spec
that cannot compile is a 400). The engine core builds one :class:`StructuredOutputManager` and
hands it to the scheduler (which owns it, as vLLM's does); it compiles grammars in a worker
thread, off the step loop, cached per spec; a request whose grammar is still compiling is not
admitted (``ready`` False, see ``Scheduler._must_wait``). Each step the scheduler fills the
bitmask of every sampling request with a grammar (``fill_bitmask``, into
``ScheduledRequest.token_bitmask``, applied by the runner) and advances its matcher with the
accepted tokens (``accept``). The matcher lives with the scheduler's request, so preemption
(recompute) keeps its state: recomputed tokens are not sampled again. A grammar that accepted
its stop token finishes its request (``stop``, also with ``ignore_eos``); one whose mask allows
no token at all (a spec no string satisfies, e.g. the regex ``[^\\s\\S]``) fails that request
alone, as the request's own fault (``bad_request``: the API answers 400; the scheduler finds it
when the first token is sampled, not from the spec). This module loads xgrammar only when a
grammar is compiled or matched.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from sloserve.engine.json_schema_support import schema_problem
from sloserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: compiled grammars kept per core (by spec)
CACHE_SIZE = 256


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs need xgrammar on the server (`make` installs it; "
                         "or pip install 'sloserve[structured]')") from None
    return xgrammar


def _grammar(spec: StructuredOutputsParams):
    """The xgrammar ``Grammar`` of a spec. Raises ValueError (with xgrammar's reason)."""
    xgr = _xgr()
    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:  # an object, as OpenAI's json_object and vLLM mean it (xgrammar's
            # builtin JSON grammar also takes a top-level array: a seeded sample produced one)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True,
                                                strict_mode=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError) as e:
        # xgrammar's messages start with "[time] file.cc:line: "
        why = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip().splitlines()[-1])
        raise ValueError(f"cannot compile the {spec.kind}: {why}") from None


def validate(spec: StructuredOutputsParams) -> None:
    """Parse the spec as the core will (no tokenizer needed). Raises ValueError: a spec that
    does not compile, or a JSON schema with a keyword the grammar would silently drop
    (:mod:`sloserve.engine.json_schema_support`)."""
    if spec.json is not None:  # before xgrammar parses it: a deep schema takes long there
        why = schema_problem(json.loads(spec.json))
        if why is not None:
            raise ValueError(f"the JSON schema {why}")
    _grammar(spec)


class RequestGrammar:
    """One request's matcher over a grammar that may still be compiling."""

    def __init__(self, future: Future, vocab_size: int):
        self._future = future
        self._vocab = vocab_size
        self._matcher = None
        self._bitmask = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed: see :attr:`error`)."""
        return self._future.done()

    @property
    def error(self) -> str | None:
        e = self._future.exception() if self._future.done() else None
        return None if e is None else f"{type(e).__name__}: {e}"

    def _m(self):
        if self._matcher is None:
            xgr = _xgr()
            self._matcher = xgr.GrammarMatcher(self._future.result())
            self._bitmask = xgr.allocate_token_bitmask(1, self._vocab)
        return self._matcher

    def fill_bitmask(self) -> bytes:
        """The tokens allowed next, as ``ScheduledRequest.token_bitmask`` expects."""
        m = self._m()
        m.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().tobytes()

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (then the
        matcher is unchanged)."""
        return bool(self._m().accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Compiles grammars for the engine core, off its step loop.

    Args:
        load_tokenizer: returns the model's ``sloserve.tokenizer.Tokenizer`` (called once, in
            the worker thread, on the first structured request).
        vocab_size: the model's vocabulary (logits columns; may exceed the tokenizer's).
    """

    def __init__(self, load_tokenizer, vocab_size: int):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sloserve-grammar")
        self._compiler = None
        self._cache: dict[str, Future] = {}
        self._lock = threading.Lock()

    def _compile(self, spec: StructuredOutputsParams):
        xgr = _xgr()
        if self._compiler is None:
            tok = self._load_tokenizer()
            if tok is None:
                raise ValueError("structured outputs need the model's tokenizer")
            info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(_grammar(spec))

    def grammar_for(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A new matcher for one request (compilation shared by every request with the same
        spec)."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                if len(self._cache) >= CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
                fut = self._cache[key] = self._pool.submit(self._compile, spec)
        return RequestGrammar(fut, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
