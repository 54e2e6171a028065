"""Incremental detokenization with stop strings.

Text is produced token by token without emitting broken UTF-8: a byte-level BPE token can end in
the middle of a multi-byte character, which decodes to U+FFFD; such text is held back until the
character completes (the prefix/read-offset method vLLM uses). Stop strings are matched on the
whole text so far, so a match that ends inside a token or spans several tokens is found; the
longest tail of the text that could still start a stop string is held back while streaming, so
no part of a stop string is ever emitted.
"""
from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: anything with decode(ids, skip_special_tokens).
        prompt_token_ids: the prompt; its last few tokens give context for the first output tokens.
        stop: stop strings (empty: none).
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stop = list(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""            # all text decoded so far (truncated at a stop string)
        self._emitted = 0         # characters of self.text already returned
        self.stopped = False      # a stop string matched
        self.matched: str | None = None  # which one

    def _decode_new(self) -> str:
        dec = self.tokenizer.decode
        prefix = dec(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip)
        full = dec(self._ids[self._prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def add_token(self, token_id: int | None, finished: bool = False) -> str:
        """Append a token (None: nothing new, e.g. a stop token that is not shown) and return
        the text that may be emitted now. With finished=True everything held back is flushed.

        After a stop string matches, `stopped` is True, `text` ends right before the match and
        further calls return "".
        """
        if self.stopped:
            return ""
        if token_id is not None:
            self._ids.append(token_id)
            new = self._decode_new()
            if new:
                search_from = max(0, len(self.text) - self._max_stop + 1)
                self.text += new
                if self.stop:
                    self._match_stop(search_from)
        if self.stopped or finished:
            end = len(self.text)
        else:
            end = len(self.text) - self._holdback()
        end = max(end, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _match_stop(self, search_from: int) -> None:
        best, which = -1, None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best == -1 or i < best):
                best, which = i, s
        if best != -1:
            self.text = self.text[:best]
            self.stopped = True
            self.matched = which

    def _holdback(self) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        for n in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
