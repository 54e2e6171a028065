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
    def processed_logits(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        """The logits a non-greedy request draws from: scaled by temperature, tokens outside
        top-k and top-p at -inf ([V] float32; a greedy request's row unchanged)."""
        if sp.greedy:
            return row
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
        return row

    @classmethod
    def _sample_row(cls, row: torch.Tensor, sp: SamplingParams, g: torch.Generator) -> int:
        probs = torch.softmax(cls.processed_logits(row, sp), dim=-1)
        return int(torch.multinomial(probs, 1, generator=g))


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: list[bytes]) -> None:
    """Set the logits of disallowed tokens to -inf in place (structured outputs).

    Args:
        logits: [S, V] float32.
        rows: the rows to constrain; masks: one per row, ceil(V / 32) little-endian int32 words
            as bytes (bit ``t % 32`` of word ``t // 32`` set: token t allowed; tokens past the
            mask's end are disallowed).
    """
    if not rows:
        return
    words = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32).view(len(rows), -1)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1   # [R, W, 32]
    allowed = bits.view(len(rows), -1).bool()
    v = logits.shape[1]
    if allowed.shape[1] < v:
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
    idx = torch.tensor(rows, dtype=torch.long)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :v], float("-inf"))
