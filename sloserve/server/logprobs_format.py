"""Logprobs (``sloserve.logprobs.Logprobs``) -> the OpenAI JSON shapes of completions and chat.

Token texts are each token decoded alone (as vLLM does); without a tokenizer a token is shown as
``token_id:<id>``. A value of -inf (a token a grammar mask or top-k/top-p ruled out) is
reported as -9999.0, vLLM's floor, since JSON has no infinity.
"""
from __future__ import annotations

import math

from sloserve.logprobs import Logprobs
from sloserve.server.protocol import (ChatTokenLogprob, ChatTopLogprob, CompletionLogProbs,
                                      PromptLogprob)

FLOOR = -9999.0
_CACHE_MAX = 65536


def _v(x: float) -> float:
    return x if math.isfinite(x) and x > FLOOR else FLOOR


class LogprobsFormatter:
    """Args: tokenizer: the served model's (``sloserve.tokenizer.Tokenizer``) or None."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            if self.tokenizer is None:
                t = f"token_id:{token_id}"
            else:
                t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < _CACHE_MAX:
                self._texts[token_id] = t
        return t

    def completion(self, token_ids: list[int], lps: list[Logprobs | None],
                   initial_offset: int = 0) -> CompletionLogProbs:
        """``token_ids`` with one Logprobs per run of them (None: a run with no values, e.g.
        the first prompt token with echo); positions are consumed in order."""
        out = CompletionLogProbs()
        offset = initial_offset
        pos = [(lp, i) for lp in lps for i in range(len(lp) if lp is not None else 1)]
        for tok, (lp, i) in zip(token_ids, pos):
            text = self.token_text(tok)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            ids, vals = lp.token_ids[i], lp.logprobs[i]
            out.token_logprobs.append(_v(vals[0]))
            out.top_logprobs.append({self.token_text(t): _v(v) for t, v in zip(ids, vals)})
        return out

    def prompt(self, lp: Logprobs | None) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position the
        prompt token's entry (its rank in the whole distribution) and the top k (ranks 1..k),
        keyed by token id."""
        out: list[dict[str, PromptLogprob] | None] = [None]
        for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.ranks) if lp else ():
            d = {str(ids[0]): PromptLogprob(logprob=_v(vals[0]), rank=rank,
                                            decoded_token=self.token_text(ids[0]))}
            for r, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
                d.setdefault(str(t), PromptLogprob(logprob=_v(v), rank=r,
                                                   decoded_token=self.token_text(t)))
            out.append(d)
        return out

    def chat(self, lp: Logprobs) -> list[ChatTokenLogprob]:
        """One entry per position: the sampled token, then its top-k alternatives."""
        out = []
        for ids, vals in zip(lp.token_ids, lp.logprobs):
            text = self.token_text(ids[0])
            out.append(ChatTokenLogprob(
                token=text, logprob=_v(vals[0]), bytes=list(text.encode("utf-8")),
                top_logprobs=[ChatTopLogprob(token=(tt := self.token_text(t)), logprob=_v(v),
                                             bytes=list(tt.encode("utf-8")))
                              for t, v in zip(ids[1:], vals[1:])]))
        return out
