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

Switching off where drafts do not pay: the worker measures what a step of 1 + k rows costs
over a decode at start-up (``WorkerInfo.verify_cost``), and each request takes the k that
maximises its expected tokens per unit of step time at its own acceptance so far, none where
no k pays (:class:`Drafter`)."""
from __future__ import annotations

from sloserve.config import ACCEPTANCE_WINDOW, SpeculativeConfig
from sloserve.step_io import DRAFT_PLACEHOLDER, VERIFY_COST_TOKENS


#: without a measurement (the simulator's cost models have theirs) and without a
#: ``num_speculative_tokens_per_batch_size`` table, a step of decodes and drafts holds at most
#: this many tokens: on the 135M model on the AMX host each draft row adds 5-10 % of a decode
#: step, and at 16 running requests drafts lost output rate (``benchmarks/README.md``)
DEFAULT_STEP_TOKENS = 8
#: the acceptance floor where nothing was measured and ``min_acceptance_rate`` is not given
DEFAULT_MIN_ACCEPTANCE_RATE = 0.1
#: k per request, from its acceptance (``Drafter.best_k``): a request is assumed to accept
#: each draft position with this probability before its first verify (about what n-gram
#: drafts reach on a chat set, 37-63 % measured), a prior worth PRIOR_WEIGHT verifies ...
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
#: ... and a verify's weight in the estimate falls by this factor with each later one
DECAY = 0.9
#: drafts of k must promise this much more output per second of step than no drafts: the
#: start-up measurement misses what a served step adds (proposing, scheduling, outputs) and
#: varies by ~10 % run to run (on the AVX2-limited host a served verify of 1 + 4 rows took
#: 2.38x a decode where the start-up measurement said 1.8-2.1x)
MIN_GAIN = 1.15
#: the acceptance the batch-size cap assumes: no k is offered that would not pay even there
MAX_ACCEPTANCE = 0.95


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify of k drafts gives when each position is accepted with probability
    ``a`` after an accepted one: 1 + a + ... + a^k (Leviathan et al. 2023)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class _Acceptance:
    """One request's acceptance: decayed counts of accepted draft positions and of verifies
    that stopped at a rejection (the estimate of its per-position rate), a window of draft
    tokens for an explicit floor, and the output count until which it takes no drafts."""
    __slots__ = ("ok", "stops", "drafted", "accepted", "off_until")

    def __init__(self):
        self.ok = self.stops = 0.0
        self.drafted = self.accepted = 0
        self.off_until = -1

    @property
    def rate(self) -> float:
        return (self.ok + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.ok + self.stops + PRIOR_WEIGHT)


class Drafter:
    """Args:
        config: the speculative config.
        quantized_step_max_tokens: the most tokens of a step that stays on the quantized
            (memory-bound) kernels (``WorkerInfo.quantized_step_max_tokens``; 0: none): a
            step with drafts stays within it.
        verify_cost: ``WorkerInfo.verify_cost``: per ``VERIFY_COST_TOKENS`` T, a step of T
            query tokens over a one-token decode, measured by the worker at start-up.
        draft_pass_cost: ``WorkerInfo.draft_pass_cost``: a model drafter's pass over a
            decode step (each of a step's k draft tokens takes one pass over the batch).

    How many drafts a request takes (none where they do not pay):

    * with a ``num_speculative_tokens_per_batch_size`` table: its k for the batch size (as
      vLLM), every request;
    * with the measurement (the default): per request, the k in 0..``num_speculative_tokens``
      that maximises its expected tokens per verify (``expected_tokens`` at its estimated
      per-position acceptance, :class:`_Acceptance`) over the step's cost relative to the
      batch's step without drafts (``cost`` of B(k + 1) over ``cost`` of B tokens, as if each
      of the B requests took k); no drafts where the best promises less than :data:`MIN_GAIN`
      (then none for :data:`~sloserve.config.ACCEPTANCE_WINDOW` output tokens, and it starts
      over from the prior);
    * without either (tests, a cost model without the terms): k drops with the batch so that
      a step holds at most :data:`DEFAULT_STEP_TOKENS` tokens.

    ``min_acceptance_rate`` (default :data:`DEFAULT_MIN_ACCEPTANCE_RATE` only where nothing
    was measured) stops a request's drafts for a window when its draft tokens over the last
    window were accepted at a lower rate.
    """

    def __init__(self, config: SpeculativeConfig, quantized_step_max_tokens: int = 0,
                 verify_cost: list[float] | None = None, draft_pass_cost: float = 0.0):
        self.config = config
        self.draft_pass_cost = draft_pass_cost
        self.quantized_step_max_tokens = quantized_step_max_tokens
        self.step_max_tokens = min(DEFAULT_STEP_TOKENS, quantized_step_max_tokens or
                                   DEFAULT_STEP_TOKENS)
        self.verify_cost = list(verify_cost or [])
        if len(self.verify_cost) != len(VERIFY_COST_TOKENS):
            self.verify_cost = []
        #: the measured points within the quantized limit (a step past it is never drafted;
        #: interpolating across the dense GEMM's jump would price the steps below it too high)
        self._points = [(t, c) for t, c in zip(VERIFY_COST_TOKENS, self.verify_cost)
                        if not quantized_step_max_tokens or t <= quantized_step_max_tokens]
        #: k per request from its acceptance and the measured cost
        self.adaptive = bool(self.verify_cost) and \
            config.num_speculative_tokens_per_batch_size is None
        self._k: dict[int, int] = {}
        self._ratios: dict[int, list[float]] = {}
        self.min_acceptance_rate = config.min_acceptance_rate
        if self.min_acceptance_rate is None:
            self.min_acceptance_rate = 0.0 if self.adaptive else DEFAULT_MIN_ACCEPTANCE_RATE
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

    def cost(self, tokens: int) -> float:
        """A step of ``tokens`` query tokens over a one-token decode, by the measurement
        (piecewise linear between the measured token counts within the quantized limit,
        linear past the last two)."""
        pts = self._points
        if len(pts) < 2:
            return pts[0][1] if pts and tokens <= pts[0][0] else float("inf")
        i = next((j for j in range(1, len(pts)) if tokens <= pts[j][0]), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def ratios(self, batch_size: int) -> list[float]:
        """Per k = 0..``num_speculative_tokens``, a step of ``batch_size`` requests with k
        drafts each over the step without, a model drafter's k passes included (inf past the
        quantized limit)."""
        r = self._ratios.get(batch_size)
        if r is None:
            b, limit = max(1, batch_size), self.quantized_step_max_tokens
            base = self.cost(b)
            r = [float("inf") if limit and b * (k + 1) > limit else
                 self.cost(b * (k + 1)) / base + k * self.draft_pass_cost
                 for k in range(self.config.num_speculative_tokens + 1)]
            if len(self._ratios) < 4096:
                self._ratios[batch_size] = r
        return r

    def best_k(self, batch_size: int, rate: float, most: int | None = None) -> int:
        """The k (at most ``most``) that maximises expected tokens per verify over the step's
        relative cost at ``batch_size`` for a request accepting each position with ``rate``;
        0 where none promises :data:`MIN_GAIN`."""
        r = self.ratios(batch_size)
        top = len(r) - 1 if most is None else min(most, len(r) - 1)
        best, gain = 0, MIN_GAIN
        for k in range(1, top + 1):
            g = expected_tokens(rate, k) / r[k]
            if g > gain:
                best, gain = k, g
        return best

    def k_for(self, batch_size: int) -> int:
        """The most draft tokens a request may take in a step with ``batch_size`` running
        requests (0: drafts are off at that size)."""
        k = self._k.get(batch_size)
        if k is not None:
            return k
        k = self.config.k_for(batch_size)
        if self.config.num_speculative_tokens_per_batch_size is not None:
            pass
        elif self.adaptive:
            k = min(k, self.best_k(batch_size, MAX_ACCEPTANCE))
        else:
            k = min(k, max(0, self.step_max_tokens // max(1, batch_size) - 1))
        if len(self._k) < 4096:
            self._k[batch_size] = k
        return k

    def describe(self) -> str:
        """The switch-off rules in words (the start-up line)."""
        if self.config.num_speculative_tokens_per_batch_size is not None:
            rule = "k per batch size from num_speculative_tokens_per_batch_size"
        else:
            runs: list[list[int]] = []  # [k, first batch size, last batch size]
            b = 1
            while b <= 256 and (k := self.k_for(b)) > 0:
                if runs and runs[-1][0] == k:
                    runs[-1][2] = b
                else:
                    runs.append([k, b, b])
                b += 1
            sizes = ", ".join(f"{k} at {lo}" + (f"-{hi}" if hi > lo else "")
                              for k, lo, hi in runs)
            if not self.adaptive:
                rule = (f"k = {sizes or 'none'} running request(s), none from {b} on (steps "
                        f"of at most {self.step_max_tokens} tokens)")
            else:
                cost = f"1 + 1 rows {self.cost(2):.2f}x a decode step" + (
                    f", a draft pass {self.draft_pass_cost:.2f}x" if self.draft_pass_cost else "")
                first = self.best_k(1, PRIOR_ACCEPTANCE)
                if not first:  # a request never drafts, so never shows a better acceptance
                    rule = (f"no drafts: at the cost measured here ({cost}) they would not pay "
                            f"at the {PRIOR_ACCEPTANCE:.0%} acceptance a request starts from "
                            f"(num_speculative_tokens_per_batch_size forces them)")
                else:
                    rule = (f"k per request from its acceptance and the cost measured here "
                            f"({cost}): {first} for a new request alone, then as its "
                            f"acceptance shows; at most {sizes} running request(s), none "
                            f"from {b} on")
        if self.min_acceptance_rate:
            rule += f"; no drafts for a request below {self.min_acceptance_rate:.0%} acceptance"
        return rule

    def propose(self, request_id: str, token_ids, num_prompt_tokens: int, max_drafts: int,
                batch_size: int = 1) -> list[int]:
        """Draft tokens to follow ``token_ids`` (a request's prompt, its first
        ``num_prompt_tokens``, and output): at most ``max_drafts`` and :meth:`k_for`
        ``batch_size``, as many as pay for this request (see the class docstring); none while
        the request is switched off. For the model methods, placeholders the worker fills in."""
        k = min(self.k_for(batch_size), max_drafts)
        if k <= 0:
            return []
        acc = self._acceptance.get(request_id)
        outputs = len(token_ids) - num_prompt_tokens
        if acc is not None and outputs < acc.off_until:
            return []
        if self.adaptive:
            if acc is None:
                acc = self._acceptance[request_id] = _Acceptance()
            k = self.best_k(batch_size, acc.rate, k)
            if k == 0:
                if self.best_k(batch_size, PRIOR_ACCEPTANCE) > 0:  # its own acceptance: off
                    acc.off_until = outputs + ACCEPTANCE_WINDOW   # for a while, then afresh
                    acc.ok = acc.stops = 0.0
                return []
        if self.proposer is None:
            return [DRAFT_PLACEHOLDER] * k
        if self.config.method == "suffix":
            return self.proposer.propose(request_id, token_ids, num_prompt_tokens, k)
        return self.proposer.propose(token_ids, k)

    def observe(self, request_id: str, num_draft_tokens: int, num_accepted: int,
                num_output_tokens: int) -> None:
        """A verify step's result for a request: its acceptance estimate, and the floor
        (``min_acceptance_rate``: after :data:`~sloserve.config.ACCEPTANCE_WINDOW` draft
        tokens accepted at a lower rate, no drafts for its next ``ACCEPTANCE_WINDOW`` output
        tokens)."""
        if not num_draft_tokens:
            return
        acc = self._acceptance.get(request_id)
        if acc is None:
            acc = self._acceptance[request_id] = _Acceptance()
        acc.ok = acc.ok * DECAY + num_accepted
        acc.stops = acc.stops * DECAY + (num_accepted < num_draft_tokens)
        floor = self.min_acceptance_rate
        if floor <= 0:
            return
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
