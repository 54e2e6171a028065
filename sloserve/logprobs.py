"""Log probabilities of consecutive positions, as plain data (they cross the runner -> scheduler
and core -> front-end seams; no torch).

Per position the first entry is the token that is there (the sampled token, or the prompt's
next token), then the ``k`` most likely tokens in descending order; ``ranks`` gives the first
entry's rank in the whole distribution (1 = the most likely). What the values are depends on
``--logprobs-mode`` (log-probabilities by default, or logits).
"""
from __future__ import annotations

import msgspec


class Logprobs(msgspec.Struct, array_like=True):
    """Attributes:
        token_ids: [positions][1 + k] token ids.
        logprobs: [positions][1 + k] their values (same shape as token_ids).
        ranks: [positions] the rank of each position's first token (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, stop: int | None = None) -> "Logprobs":
        """Positions [start, stop) as a new object."""
        return Logprobs(self.token_ids[start:stop], self.logprobs[start:stop],
                        self.ranks[start:stop])

    def extend(self, other: "Logprobs") -> None:
        """Append ``other``'s positions."""
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks

    @classmethod
    def empty(cls) -> "Logprobs":
        return cls([], [], [])
