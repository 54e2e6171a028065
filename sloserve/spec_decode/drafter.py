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


#: without a ``num_speculative_tokens_per_batch_size`` table, a step of decodes and drafts
#: holds at most this many tokens (k drops with the batch): on the 135M model (AMX host,
#: ``benchmarks/verify_cost.py``) each draft row adds 5-10 % of a decode step's time while the
#: step stays on the quantized kernels, and a step past their limit costs 2-4x a decode step;
#: at 16 running requests drafts of k = 1-4 lost 1-23 % of the output rate on `copy`
#: (``benchmarks/README.md``, "Speculative decoding"), at 1 request k = 4 won 2.3x
DEFAULT_STEP_TOKENS = 8


class Drafter:
    """Args:
        config: the speculative config.
        quantized_step_max_tokens: the most tokens of a step that stays on the quantized
            (memory-bound) kernels (``WorkerInfo.quantized_step_max_tokens``; 0: none).
            Without a ``num_speculative_tokens_per_batch_size`` table, k drops with the batch
            so that a step of decodes and their drafts holds at most the smaller of it and
            :data:`DEFAULT_STEP_TOKENS` tokens (k = 4 up to one request, 3 at two, 1 at three
            and four, none from five on).
    """

    def __init__(self, config: SpeculativeConfig, quantized_step_max_tokens: int = 0):
        self.config = config
        self.step_max_tokens = min(DEFAULT_STEP_TOKENS, quantized_step_max_tokens or
                                   DEFAULT_STEP_TOKENS)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def k_for(self, batch_size: int) -> int:
        """Draft tokens per request in a step with ``batch_size`` running requests."""
        k = self.config.k_for(batch_size)
        if self.config.num_speculative_tokens_per_batch_size is None:
            k = min(k, max(0, self.step_max_tokens // max(1, batch_size) - 1))
        return k

    def propose(self, token_ids, max_drafts: int, batch_size: int = 1) -> list[int]:
        """Draft tokens to follow ``token_ids`` (a request's prompt and output): at most
        ``max_drafts`` and :meth:`k_for` ``batch_size``."""
        k = min(self.k_for(batch_size), max_drafts)
        return self.proposer.propose(token_ids, k) if k > 0 else []
