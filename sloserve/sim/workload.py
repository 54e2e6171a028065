"""Workloads for the simulator: the bench's generators with prompts that are only lengths."""
from __future__ import annotations


class LengthOnlyFactory:
    """Stands in for :class:`~sloserve.bench.datasets.PromptFactory` where only token counts
    matter: ``make(n)`` gives a placeholder text of ``n`` words counted as ``n`` tokens, so the
    ``random``, ``mixed``, ``shared-prefix`` and ``trace`` generators run without a tokenizer.

    Every word ever made is new (`` w0 w1 ...``), so two prompts share a prefix exactly when the
    workload built them from the same text (a ``shared-prefix`` group), as with real prompts; the
    simulator turns words into stand-in token ids for its prefix cache."""

    tok = None

    def __init__(self):
        self._next = 0

    def make(self, num_tokens: int) -> tuple[str, int]:
        """(placeholder text, num_tokens). Raises ValueError for num_tokens < 1."""
        if num_tokens < 1:
            raise ValueError(f"prompt length must be >= 1 token, got {num_tokens}")
        start, self._next = self._next, self._next + num_tokens
        return "".join(f" w{i}" for i in range(start, start + num_tokens)), num_tokens

    def count(self, text: str) -> int:
        """Tokens of a placeholder text (one per word)."""
        return len(text.split())
