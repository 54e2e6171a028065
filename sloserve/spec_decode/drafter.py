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
    """Args:
        config: the speculative config.
        step_max_tokens: the most tokens of a step that stays on the quantized (memory-bound)
            kernels (``WorkerInfo.quantized_step_max_tokens``; 0: no such limit). Without a
            ``num_speculative_tokens_per_batch_size`` table, k drops with the batch so that a
            step of decodes and their drafts stays within it: past it the step runs on a dense
            GEMM and costs 2-4x a decode step (``benchmarks/verify_cost.py``), more than the
            drafts win back.
    """

    def __init__(self, config: SpeculativeConfig, step_max_tokens: int = 0):
        self.config = config
        self.step_max_tokens = step_max_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def k_for(self, batch_size: int) -> int:
        """Draft tokens per request in a step with ``batch_size`` running requests."""
        k = self.config.k_for(batch_size)
        if self.config.num_speculative_tokens_per_batch_size is None and self.step_max_tokens:
            k = min(k, max(0, self.step_max_tokens // max(1, batch_size) - 1))
        return k

    def propose(self, token_ids, max_drafts: int, batch_size: int = 1) -> list[int]:
        """Draft tokens to follow ``token_ids`` (a request's prompt and output): at most
        ``max_drafts`` and :meth:`k_for` ``batch_size``."""
        k = min(self.k_for(batch_size), max_drafts)
        return self.proposer.propose(token_ids, k) if k > 0 else []
