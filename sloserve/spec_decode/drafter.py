"""Draft tokens for the engine core: before each step the core asks the scheduler which
requests decode next and may take drafts (``Scheduler.draft_candidates``: running, past their
prompt, with the count that ``max_tokens`` and ``max_model_len`` leave) and sets their
``spec_token_ids`` from :meth:`Drafter.propose`. The scheduler puts the drafts after the
request's last token (within the token budget), the runner verifies them in the step's one
forward pass and the scheduler rolls the rejected positions' KV back (``KVCacheManager.trim``;
they are never cached).

Verification (``sloserve.model.runner``): a draft token is kept while it equals the token sampled
at its position; the first sampled token that differs, or the one after the last draft, is kept
too. That is exact for any drafter that proposes one token with certainty (n-gram, suffix, a
greedy draft model): each kept token is the token the request would have sampled there. A
``probabilistic`` draft model's tokens carry their draft distribution q and are verified by
rejection sampling (accept with min(1, p/q), else resample from norm(max(0, p - q))).

Where the drafts come from:

* ``ngram`` and ``suffix``: here, in plain Python and numpy, from the request's tokens (and for
  ``suffix`` the outputs of other requests);
* ``draft_model`` and ``layer_skip``: in the worker, inside the step: the core proposes
  :data:`~sloserve.step_io.DRAFT_PLACEHOLDER` tokens (so the scheduler counts and places them)
  and the runner fills them in before the verify pass (``sloserve.spec_decode.model_drafter``).

Switching off: k drops with the batch (:meth:`Drafter.k_for`), and a request whose drafts are
accepted below ``min_acceptance_rate`` over a window gets none for a while
(:meth:`Drafter.observe`)."""
from __future__ import annotations

from sloserve.config import ACCEPTANCE_WINDOW, SpeculativeConfig
from sloserve.step_io import DRAFT_PLACEHOLDER


#: without a ``num_speculative_tokens_per_batch_size`` table, a step of decodes and drafts
#: holds at most this many tokens (k drops with the batch): on the 135M model (AMX host,
#: ``benchmarks/verify_cost.py``) each draft row adds 5-10 % of a decode step's time while the
#: step stays on the quantized kernels, and a step past their limit costs 2-4x a decode step;
#: at 16 running requests drafts of k = 1-4 lost 1-23 % of the output rate on `copy`
#: (``benchmarks/README.md``, "Speculative decoding"), at 1 request k = 4 won 2.3x
DEFAULT_STEP_TOKENS = 8


class _Acceptance:
    """One request's acceptance over its current window (the floor's state)."""
    __slots__ = ("drafted", "accepted", "off_until")

    def __init__(self):
        self.drafted = self.accepted = 0
        self.off_until = -1  # no drafts while the request has fewer output tokens than this


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
        self.proposer = None
        if config.method == "ngram":
            from sloserve.spec_decode.ngram import NgramProposer
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            from sloserve.spec_decode.suffix import SuffixProposer
            self.proposer = SuffixProposer(
                max_tree_depth=config.suffix_decoding_max_tree_depth,
                max_cached_requests=config.suffix_decoding_max_cached_requests,
                max_spec_factor=config.suffix_decoding_max_spec_factor,
                min_token_prob=config.suffix_decoding_min_token_prob)
        self._acceptance: dict[str, _Acceptance] = {}

    def k_for(self, batch_size: int) -> int:
        """Draft tokens per request in a step with ``batch_size`` running requests."""
        k = self.config.k_for(batch_size)
        if self.config.num_speculative_tokens_per_batch_size is None:
            k = min(k, max(0, self.step_max_tokens // max(1, batch_size) - 1))
        return k

    def propose(self, request_id: str, token_ids, num_prompt_tokens: int, max_drafts: int,
                batch_size: int = 1) -> list[int]:
        """Draft tokens to follow ``token_ids`` (a request's prompt, its first
        ``num_prompt_tokens``, and output): at most ``max_drafts`` and :meth:`k_for`
        ``batch_size``; none while the request is below the acceptance floor. For the model
        methods, placeholders the worker fills in."""
        k = min(self.k_for(batch_size), max_drafts)
        if k <= 0:
            return []
        acc = self._acceptance.get(request_id)
        if acc is not None and len(token_ids) - num_prompt_tokens < acc.off_until:
            return []
        if self.proposer is None:
            return [DRAFT_PLACEHOLDER] * k
        if self.config.method == "suffix":
            return self.proposer.propose(request_id, token_ids, num_prompt_tokens, k)
        return self.proposer.propose(token_ids, k)

    def observe(self, request_id: str, num_draft_tokens: int, num_accepted: int,
                num_output_tokens: int) -> None:
        """A verify step's result for a request (the acceptance floor): after
        :data:`~sloserve.config.ACCEPTANCE_WINDOW` draft tokens, a rate below
        ``min_acceptance_rate`` stops its drafts for its next ``ACCEPTANCE_WINDOW`` output
        tokens."""
        floor = self.config.min_acceptance_rate
        if not num_draft_tokens or floor <= 0:
            return
        acc = self._acceptance.get(request_id)
        if acc is None:
            acc = self._acceptance[request_id] = _Acceptance()
        acc.drafted += num_draft_tokens
        acc.accepted += num_accepted
        if acc.drafted >= ACCEPTANCE_WINDOW:
            if acc.accepted < floor * acc.drafted:
                acc.off_until = num_output_tokens + ACCEPTANCE_WINDOW
            acc.drafted = acc.accepted = 0

    def finish(self, request_id: str) -> None:
        """A request finished or was aborted: drop what is kept for it (a ``suffix`` proposer
        keeps its output among the recent outputs it drafts from)."""
        self._acceptance.pop(request_id, None)
        if self.config.method == "suffix":
            self.proposer.finish(request_id)
