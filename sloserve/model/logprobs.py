"""Log probabilities of chosen tokens and the top-k alternatives, from logits rows (torch).

``--logprobs-mode`` (vLLM's) picks the values: ``raw_logprobs`` (log-softmax of the model's
logits, after any structured-output mask), ``processed_logprobs`` (of the logits the sampler
draws from: temperature, top-k, top-p applied), or the logits themselves (``*_logits``).
"""
from __future__ import annotations

import torch

from sloserve.logprobs import Logprobs


def logprob_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """[R, V] float32 logits -> the values ``mode`` reports ([R, V] float32)."""
    if mode.endswith("_logits"):
        return logits.float()
    return torch.log_softmax(logits.float(), dim=-1)


def gather(values: torch.Tensor, token_ids: list[int], k: int) -> Logprobs:
    """Per row r: ``token_ids[r]``'s value and rank, then the ``k`` largest values.

    Args:
        values: [R, V] float32 (from :func:`logprob_values`).
        token_ids: R token ids (the sampled or the prompt's next tokens).
        k: how many top entries per row (0: the chosen token only).

    Returns:
        Logprobs with R positions of 1 + k entries each.
    """
    if not token_ids:
        return Logprobs.empty()
    ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
    chosen = values.gather(1, ids)                                # [R, 1]
    ranks = ((values > chosen).sum(dim=1) + 1).tolist()
    if k > 0:
        top_v, top_i = values.topk(min(k, values.shape[1]), dim=1)
        all_ids = torch.cat([ids, top_i], dim=1).tolist()
        all_v = torch.cat([chosen, top_v], dim=1).tolist()
    else:
        all_ids, all_v = ids.tolist(), chosen.tolist()
    return Logprobs(all_ids, all_v, ranks)
