"""Verification of a probabilistic draft (speculative sampling, Leviathan et al. 2023; Chen et
al. 2023): draft token d at a position, proposed with probability q(d), is accepted with
probability min(1, p(d) / q(d)) under the target's distribution p; the first rejected position
takes a sample of norm(max(0, p - q)) instead, and when every draft is accepted the position
after the last one takes a sample of p. Each kept token then follows p exactly, whatever q is.

p is the distribution the request samples from without speculation: temperature, top-k and
top-p applied to the target's logits (``Sampler.probs``), after the grammar's mask.
Deterministic drafts (n-gram, suffix, greedy draft models) do not come here: for them q is a
point mass and the runner's sample-and-match is this rule.

Randomness (``sloserve.model.sampler.uniform``): the acceptance test of the draft at token
index t takes the request's uniform for (t, accept), and the token that ends the run at index t
(a resample or, after the last draft, a sample of p) its uniform for (t, sample), the one it
would sample there without drafts. The requests of a step are verified together."""
from __future__ import annotations

import torch

from sloserve.model.sampler import draw


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                     u_accept: torch.Tensor, u_end: torch.Tensor
                     ) -> tuple[list[list[int]], list[int]]:
    """Verify the drafts of R requests with k drafts each.

    Args:
        p: [R, k + 1, V] target probabilities (the last row: the position after the last draft).
        q: [R, k, V] the draft distributions the drafts were sampled from.
        drafts: [R, k] int64 draft tokens.
        u_accept: [R, k] float64 uniforms of the acceptance tests.
        u_end: [R, k + 1] float64 uniforms of the token that ends the run, per position where
            it may end.

    Returns:
        (per request the kept tokens: its accepted drafts and one more; per request the number
        of drafts accepted).
    """
    R, k = drafts.shape
    idx = drafts[..., None]
    pd = p[:, :k].gather(-1, idx)[..., 0].double()
    qd = q.gather(-1, idx)[..., 0].double()
    ok = (qd > 0) & (u_accept * qd < pd)                      # u < p / q, no division
    accepted = ok.long().cumprod(-1).sum(-1)                  # [R]: drafts before a rejection
    rows = torch.arange(R)
    last = p[rows, accepted]                                  # [R, V]
    rejected = accepted < k
    if bool(rejected.any()):
        j = accepted.clamp(max=k - 1)
        resid = (last - q[rows, j]).clamp(min=0)
        good = resid.sum(-1) > 0                              # p == q up to rounding: p itself
        last = torch.where((rejected & good)[:, None], resid, last)
    ends = draw(last, u_end[rows, accepted]).tolist()
    n = accepted.tolist()
    d = drafts.tolist()
    return [d[r][:n[r]] + [ends[r]] for r in range(R)], n
