"""Reasoning parsers: ``<think>...</think>`` text -> ``reasoning_content``, the rest -> content,
whole or streamed (vLLM's ``--reasoning-parser`` names).

- ``deepseek_r1``: everything up to ``</think>`` is reasoning (the chat template may have
  written the ``<think>`` itself; one the model writes is dropped); no ``</think>``: all of it.
- ``qwen3``: an output that starts with ``<think>`` is reasoning up to ``</think>``; any other
  is content.

Streamed (:meth:`ReasoningParser.streamer`), each delta splits into a reasoning part and a
content part, a tag held back while it may still be arriving; the content part is what a tool
parser reads next (``sloserve.server.tool_parsers``), so a call after the reasoning is parsed
as it would be without it.
"""
from __future__ import annotations

from dataclasses import dataclass

from sloserve.server.tool_parsers import named, partial_tag

START, END = "<think>", "</think>"


@dataclass
class Split:
    """Reasoning and content of an output (None where there is none)."""

    reasoning: str | None
    content: str | None


class ReasoningStreamer:
    """One streamed choice: :meth:`feed` each delta, then :meth:`finish`; each returns
    (reasoning delta, content delta)."""

    def __init__(self, needs_start: bool):
        self.needs_start = needs_start  # qwen3: reasoning only after a leading <think>
        self.mode = "start"  # then "reasoning", then "content"
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        if self.mode == "start":  # a leading <think> may be arriving
            s = self.buf.lstrip()
            if s.startswith(START):
                self.buf, self.mode = s[len(START):], "reasoning"
            elif s and not START.startswith(s):
                self.mode = "content" if self.needs_start else "reasoning"
            else:
                return "", ""
        if self.mode == "reasoning":
            i = self.buf.find(END)
            if i < 0:
                keep = partial_tag(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf, self.mode = self.buf[:i], self.buf[i + len(END):], "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self.buf = self.buf, ""
        if self.mode == "content" or (self.mode == "start" and self.needs_start):
            return "", buf
        return buf, ""  # a held-back piece of a tag that never came is reasoning


class ReasoningParser:
    """A ``--reasoning-parser``."""

    name = ""
    needs_start = False

    def extract(self, text: str) -> Split:
        s = self.streamer()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        r, c = r1 + r2, c1 + c2
        return Split(r if r else None, c if c else None)

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self.needs_start)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    needs_start = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name`` (ValueError for an unknown one)."""
    return named(REASONING_PARSERS, name, "--reasoning-parser")
