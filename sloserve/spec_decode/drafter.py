"""The engine core's side of speculative decoding: before each step, the requests that decode
get draft tokens from the proposer (``Request.spec_token_ids``); the scheduler puts them after the
request's last token (within the token budget and ``max_model_len``), the runner verifies them in
the step's one forward pass (a draft token is kept while it equals the token sampled at its
position; the first sampled token that differs, or the one after the last draft, is kept too), and
the scheduler rolls the rejected positions' KV back (``KVCacheManager.trim``; they are never
cached). Sample-and-match is exact for any deterministic drafter at any temperature: each kept
token is the token the request would have sampled there.

Drafts are cut to what ``max_tokens`` leaves (the last token of a request is never a draft's).
Requests with a structured-output grammar get no drafts (their mask is one per step)."""
from __future__ import annotations

from sloserve.engine.request import Request, RequestStatus
from sloserve.spec_decode.config import SpeculativeConfig
from sloserve.spec_decode.ngram import NgramProposer


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, requests) -> None:
        """Set ``spec_token_ids`` of each request in ``requests`` that decodes next."""
        k = self.config.num_speculative_tokens
        for req in requests:
            req.spec_token_ids = self._drafts(req, k)

    def _drafts(self, req: Request, k: int) -> list[int]:
        if req.status is not RequestStatus.RUNNING or req.num_tokens_to_compute != 1 \
                or req.grammar is not None:
            return []
        sp = req.sampling_params
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - req.num_output_tokens - 1)
        if k < 1:
            return []
        return self.proposer.propose(req.all_token_ids, k)
