"""The n-gram proposer (prompt lookup decoding, as vLLM's ``ngram`` method): the draft is what
followed the latest earlier occurrence of the longest suffix of the request's tokens (prompt and
output) that is ``min_n`` to ``max_n`` tokens long. No model, no state; numpy only."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (fewer where the match is near the
        end; none without a match)."""
        toks = np.asarray(token_ids, dtype=np.int64)
        size = toks.shape[0]
        if k < 1 or size < self.min_n + 1:
            return []
        head = toks[:-1]  # an occurrence must be followed by a token
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            windows = sliding_window_view(head, n)
            hits = np.flatnonzero((windows == toks[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return toks[start:start + k].tolist()
        return []
