"""Step-time cost models: the duration of one engine step from its composition.

A step's composition is what the scheduler put in it: the decodes (one token each, at their
context lengths, each with the draft tokens it verifies, speculative decoding) and the prefill
chunks (tokens and the position they start at). The profiled model is linear in the features
DistServe's latency model uses (Zhong et al. OSDI'24, section 4.1: prefill time ~ a + b * sum(L)
+ c * sum(L^2), decode time ~ a + b * sum(context) + c * batch), extended to the hybrid batches
of chunked prefill by adding the two parts in one step, and to verify steps:

    t = c0 + c1 * decodes + c2 * sum(decode contexts) + c3 * prefill tokens
           + c4 * sum over chunks of n * (start + n)          (attention of a chunk: n queries
                                                                over start + n keys)
           + c5 * prefill chunks                               (fixed cost of each chunk)
           + c6 * draft tokens                                 (a verify step's extra query
                                                                rows: the k drafts after a
                                                                decode's token)
           + c7 * [step tokens > quantized step limit]         (the dense-GEMM crossover)

fitted by least squares to step times measured on the real engine. The per-chunk term carries
a new request's fixed set-up, without which steps that start short prompts are under-priced.

The last term is the crossover of the CPU engine's linear kernels: a step of at most
``quantized_step_max_tokens`` query tokens (decodes + drafts + prefill tokens; the worker's
``WorkerInfo.quantized_step_max_tokens``, measured at its start-up) runs on the quantized,
memory-bound kernels, a larger one on a dense GEMM that reads the dense weights, a fixed cost
of its own (on the AMX host a verify step past the limit costs 2-4x a decode step,
``benchmarks/verify_cost.py``). Before it was a feature, every prefill step of a profile was
past the limit and the per-chunk term c5 carried that cost too; with verify steps in the
profile (``sloserve profile``'s verify grid) the two come apart. A model whose limit is 0
(unknown, or no quantized weights) has no crossover: the term is 0.

Profiles written before the verify terms have 5 or 6 coefficients; they load with c6 = c3 (a
draft token priced as a prefill token: one more query row through the step) and c7 = 0 (no
crossover), see :class:`LinearCostModel`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from sloserve.step_io import attention_work

FEATURES = ("overhead", "decodes", "decode_context_tokens", "prefill_tokens", "prefill_attention",
            "prefill_chunks", "draft_tokens", "dense_step")
#: index of each feature in :data:`FEATURES`
_F = {name: i for i, name in enumerate(FEATURES)}


@dataclass(frozen=True)
class StepComposition:
    """What one step computes.

    Attributes:
        decode_contexts: context length of each decode after the step, its new token and its
            draft tokens included (tokens; ``SchedulerOutput.composition()``).
        prefill_chunks: (tokens in the chunk, start position) of each prefill chunk.
        decode_drafts: draft tokens each decode verifies (speculative decoding: a decode of
            1 + k query tokens), in ``decode_contexts`` order; () when none has any (a tuple
            of zeros is normalized to ()).

    Raises:
        ValueError: ``decode_drafts`` given with another length than ``decode_contexts``, or
            a negative count.
    """

    decode_contexts: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_drafts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.decode_drafts:
            if len(self.decode_drafts) != len(self.decode_contexts) \
                    or min(self.decode_drafts) < 0:
                raise ValueError(f"decode_drafts {self.decode_drafts} must hold a count >= 0 "
                                 f"for each of the {len(self.decode_contexts)} decodes")
            if not any(self.decode_drafts):
                object.__setattr__(self, "decode_drafts", ())

    @classmethod
    def of(cls, out) -> "StepComposition":
        """From a :class:`~sloserve.step_io.SchedulerOutput`: its ``composition()``, and the
        draft tokens of each decode (its query tokens past the first)."""
        dec, pre = out.composition()
        return cls(dec, pre, tuple(s.num_new_tokens - 1 for s in out.scheduled if s.is_decode))

    @property
    def num_drafts(self) -> int:
        """Draft tokens the step verifies (all decodes)."""
        return sum(self.decode_drafts)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step: decodes, their drafts and prefill tokens."""
        return len(self.decode_contexts) + self.num_drafts + sum(n for n, _ in self.prefill_chunks)

    def features(self, quantized_step_max_tokens: int = 0) -> np.ndarray:
        """The model's feature vector (see the module docstring), float64 of shape (8,);
        ``dense_step`` is 1 when the step has more than ``quantized_step_max_tokens`` tokens
        (0: no crossover, always 0)."""
        return np.array([
            1.0,
            len(self.decode_contexts),
            sum(self.decode_contexts),
            sum(n for n, _ in self.prefill_chunks),
            sum(n * (s + n) for n, s in self.prefill_chunks),
            len(self.prefill_chunks),
            self.num_drafts,
            1.0 if 0 < quantized_step_max_tokens < self.num_tokens else 0.0,
        ], dtype=np.float64)


class CostModel(Protocol):
    """Anything that prices a step (seconds)."""

    def step_time(self, comp: StepComposition) -> float: ...


def _default_coef(coef: list[float], name: str) -> float:
    """What a coefficient the samples (or an older profile) do not determine defaults to: a
    draft token costs what a prefill token does (one more query row through the step), the
    crossover nothing."""
    return coef[_F["prefill_tokens"]] if name == "draft_tokens" else 0.0


@dataclass
class LinearCostModel:
    """The profiled cost model: ``t = coef . features`` (seconds; coefficients per feature in
    :data:`FEATURES` order: s, s/decode, s/context token, s/prefill token, s/attention pair,
    s/chunk, s/draft token, s per step past the quantized limit).

    Older profiles load: five coefficients (before the per-chunk term) get a zero one; five or
    six (before the verify terms) get ``draft_tokens`` = the ``prefill_tokens`` coefficient
    and ``dense_step`` = 0; :attr:`defaulted` names the coefficients so filled in.

    Attributes:
        quantized_step_max_tokens: the step limit of the quantized kernels the profile was
            measured under (``dense_step``'s threshold; 0: no crossover). The simulated worker
            reports it, so the simulated drafter's k (``Drafter.k_for``) follows it too.

    Raises:
        ValueError: not a list of 5, 6 or 8 coefficients, or one negative, infinite or NaN;
            a limit that is not an integer >= 0.
    """

    coef: list[float] = field(default_factory=lambda: [0.0] * len(FEATURES))
    quantized_step_max_tokens: int = 0
    defaulted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.coef, (list, tuple)):
            raise ValueError(f"coefficients must be a list of {len(FEATURES)} numbers, "
                             f"got {self.coef!r}")
        self.coef = list(self.coef)
        if len(self.coef) not in (5, 6, len(FEATURES)):
            raise ValueError(f"need {len(FEATURES)} coefficients ({', '.join(FEATURES)}; a "
                             f"profile of before the verify terms: the first 6 or 5), got "
                             f"{len(self.coef)}")
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < math.inf
                   for c in self.coef):
            raise ValueError(f"coefficients must be finite numbers >= 0, got {self.coef}")
        missing = FEATURES[len(self.coef):]
        if len(self.coef) == 5:
            self.coef.append(0.0)
        for name in FEATURES[len(self.coef):]:
            self.coef.append(_default_coef(self.coef, name))
        self.defaulted = tuple(dict.fromkeys((*self.defaulted, *missing)))
        q = self.quantized_step_max_tokens
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ValueError(f"quantized_step_max_tokens must be an integer >= 0, got {q!r}")

    def step_time(self, comp: StepComposition) -> float:
        """Seconds of one step."""
        return float(np.dot(self.coef, comp.features(self.quantized_step_max_tokens)))

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepComposition, float]],
            quantized_step_max_tokens: int = 0) -> "LinearCostModel":
        """Non-negative least squares on (composition, measured seconds) pairs.

        Solved as ordinary least squares, then any negative coefficient is fixed at 0 and the
        rest refitted (a few features, so this active-set loop ends in at most 8 rounds). A
        feature no sample has (no verify step, no step past the limit) is left out of the fit
        and gets its default (see :class:`LinearCostModel`; named in ``defaulted``).

        Raises:
            ValueError: fewer samples than features to fit.
        """
        if not samples:
            raise ValueError("need samples to fit, got none")
        x = np.stack([c.features(quantized_step_max_tokens) for c, _ in samples])
        y = np.array([t for _, t in samples], dtype=np.float64)
        unseen = [j for j in range(len(FEATURES)) if j >= _F["draft_tokens"] and not x[:, j].any()]
        active = [j for j in range(len(FEATURES)) if j not in unseen]
        if len(samples) < len(active):
            raise ValueError(f"need at least {len(active)} samples to fit, got {len(samples)}")
        coef = np.zeros(len(FEATURES))
        for _ in range(len(FEATURES)):
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (sol >= 0).all():
                coef[:] = 0.0
                coef[active] = sol
                break
            active = [a for a, v in zip(active, sol) if v > 0]
            if not active:
                break
        out = [float(v) for v in coef]
        for j in unseen:
            out[j] = _default_coef(out, FEATURES[j])
        return cls(out, quantized_step_max_tokens, tuple(FEATURES[j] for j in unseen))

    def relative_errors(self, samples: Sequence[tuple[StepComposition, float]]) -> np.ndarray:
        """|predicted - measured| / measured for each sample."""
        return np.array([abs(self.step_time(c) - t) / t for c, t in samples])


@dataclass
class OverlapCostModel:
    """A roofline-shaped step: memory and compute overlap, so a step costs the larger of the
    two. ``t = overhead + max(decode_step_s, (prefill + draft tokens) / prefill_tokens_per_s)``.

    This is the regime chunked prefill is made for (Sarathi-Serve, Agrawal et al. OSDI'24,
    section 3): a decode step is memory-bound (``decode_step_s`` whatever the batch), so prefill
    tokens ride in it free until their compute time exceeds the memory time. The lecture's
    example: an 8B-class model on an H100, ``decode_step_s`` 0.022, ``prefill_tokens_per_s``
    35,000.

    Raises:
        ValueError: a non-positive rate or a negative time.
    """

    decode_step_s: float
    prefill_tokens_per_s: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.prefill_tokens_per_s < math.inf:
            raise ValueError(f"prefill_tokens_per_s must be finite and > 0, got "
                             f"{self.prefill_tokens_per_s}")
        if not (0 <= self.decode_step_s < math.inf and 0 <= self.overhead_s < math.inf):
            raise ValueError("decode_step_s and overhead_s must be finite and >= 0")

    def step_time(self, comp: StepComposition) -> float:
        """Seconds of one step (draft tokens are compute like prefill tokens: they ride in the
        memory-bound step until the compute exceeds it)."""
        compute = (sum(n for n, _ in comp.prefill_chunks) + comp.num_drafts) \
            / self.prefill_tokens_per_s
        return self.overhead_s + max(self.decode_step_s if comp.decode_contexts else 0.0, compute)


@dataclass
class RooflineCostModel:
    """A step priced on the roofline (Williams et al. 2009) from the calculator's specs:
    ``t = overhead + max(FLOP / (peak x compute_eff), bytes / (bandwidth x memory_eff))``, per
    GPU under tensor parallelism ``tp`` (FLOP and bytes split evenly; communication not priced).
    FLOP and bytes are :class:`sloserve.roofline.step.StepRoofline`'s (its docstring).

    Attributes:
        spec, hw: a ``ModelSpec`` and a ``Hardware`` (``sloserve.roofline``).
        dtype: weight / activation / KV dtype name (``bf16``, ``fp8``...).
    """

    spec: object
    hw: object
    dtype: str = "bf16"
    tp: int = 1
    compute_eff: float = 0.6
    memory_eff: float = 0.8
    overhead_s: float = 0.0
    _roof: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from sloserve.roofline.step import StepRoofline
        if self.tp < 1 or not (0 < self.compute_eff <= 1 and 0 < self.memory_eff <= 1):
            raise ValueError("tp must be >= 1 and efficiencies in (0, 1]")
        if not 0 <= self.overhead_s < math.inf:
            raise ValueError(f"overhead must be a finite number of seconds >= 0, got "
                             f"{self.overhead_s}")
        self._roof = StepRoofline(self.spec, self.hw, self.dtype)

    @property
    def _per(self) -> dict:
        return self._roof.per

    def step_time(self, comp: StepComposition) -> float:
        """Seconds of one step."""
        pairs, kv_tokens = attention_work(comp.decode_contexts, comp.prefill_chunks,
                                          comp.decode_drafts)
        flops, nbytes = self._roof.flops_bytes(
            comp.num_tokens, len(comp.decode_contexts) + len(comp.prefill_chunks), pairs,
            kv_tokens)
        peak = self.hw.peak(self.dtype) * self.compute_eff
        bw = self.hw.mem_bandwidth * self.memory_eff
        return self.overhead_s + max(flops / peak, nbytes / bw) / self.tp
