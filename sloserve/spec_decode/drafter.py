"""Draft tokens for the engine core: before each step the core asks the scheduler which
requests decode next and may take drafts (``Scheduler.draft_candidates``: running, past their
prompt, no structured-output grammar, with the count that ``max_tokens`` leaves) and sets their
``spec_token_ids`` from :meth:`Drafter.propose`. The scheduler puts the drafts after the
request's last token (within the token budget and ``max_model_len``), the runner verifies them in
the step's one forward pass (a draft token is kept while it equals the token sampled at its
position; the first sampled token that differs, or the one after the last draft, is kept too),
and the scheduler rolls the rejected positions' KV back (``KVCacheManager.trim``; they are never
cached). Sample-and-match is exact for any deterministic drafter at any temperature: each kept
token is the token the request would have sampled there.

Plain Python and numpy; the methods that need a model run in the worker (not yet)."""
from __future__ import annotations

from sloserve.config import SpeculativeConfig
from sloserve.spec_decode.ngram import NgramProposer


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, token_ids, max_drafts: int, batch_size: int = 1) -> list[int]:
        """Draft tokens to follow ``token_ids`` (a request's prompt and output): at most
        ``max_drafts`` and the k for ``batch_size`` running requests
        (``SpeculativeConfig.k_for``)."""
        k = min(self.config.k_for(batch_size), max_drafts)
        return self.proposer.propose(token_ids, k) if k > 0 else []
