"""Workloads for the simulator: the bench's generators with prompts that are only lengths."""
from __future__ import annotations


class LengthOnlyFactory:
    """Stands in for :class:`~sloserve.bench.datasets.PromptFactory` where only token counts
    matter: ``make(n)`` gives a placeholder text of ``n`` words counted as ``n`` tokens, so the
    ``random``, ``mixed``, ``shared-prefix`` and ``trace`` generators run without a tokenizer."""

    tok = None

    def make(self, num_tokens: int) -> tuple[str, int]:
        """(placeholder text, num_tokens). Raises ValueError for num_tokens < 1."""
        if num_tokens < 1:
            raise ValueError(f"prompt length must be >= 1 token, got {num_tokens}")
        return " x" * num_tokens, num_tokens

    def count(self, text: str) -> int:
        """Tokens of a placeholder text (one per word)."""
        return len(text.split())
