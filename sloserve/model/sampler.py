"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from sloserve.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row of logits.

    Every request that is not greedy draws from its own torch.Generator, seeded with its `seed`
    (or, without one, from the engine's seeded RNG when the request first samples), so a request's
    tokens do not depend on which other requests share its batch.
    """

    def __init__(self, seed: int = 0):
        self._rng = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, sp: SamplingParams) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            seed = sp.seed if sp.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._rng))
            g = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return g

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, request_ids: list[str],
                 params: list[SamplingParams]) -> list[int]:
        """Sample.

        Args:
            logits: [S, V] float32.
            request_ids, params: one per row.

        Returns:
            S token ids.
        """
        out = logits.argmax(dim=-1).tolist()
        for i, (rid, sp) in enumerate(zip(request_ids, params)):
            if sp.greedy:
                continue
            out[i] = self._sample_row(logits[i], sp, self._generator(rid, sp))
        return out

    @staticmethod
    def _sample_row(row: torch.Tensor, sp: SamplingParams, g: torch.Generator) -> int:
        row = row / sp.temperature
        if 0 < sp.top_k < row.shape[-1]:
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the mass before it already reaches top_p; the most likely token
            # always stays (a top_p that rounds to 0 in float32 must not drop every token)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= sp.top_p
            drop[0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=g))
