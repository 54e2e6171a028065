"""Step-time cost models: the duration of one engine step from its composition.

A step's composition is what the scheduler put in it: the decodes (one token each, at their
context lengths) and the prefill chunks (tokens and the position they start at). The profiled
model is linear in the features DistServe's latency model uses (Zhong et al. OSDI'24, section
4.1: prefill time ~ a + b * sum(L) + c * sum(L^2), decode time ~ a + b * sum(context) + c * batch),
extended to the hybrid batches of chunked prefill by adding the two parts in one step:

    t = c0 + c1 * decodes + c2 * sum(decode contexts) + c3 * prefill tokens
           + c4 * sum over chunks of n * (start + n)          (attention of a chunk: n queries
                                                                over start + n keys)
           + c5 * prefill chunks                               (fixed cost of each chunk)

fitted by least squares to step times measured on the real engine. The per-chunk term carries
a new request's fixed set-up, without which steps that start short prompts are under-priced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

FEATURES = ("overhead", "decodes", "decode_context_tokens", "prefill_tokens", "prefill_attention",
            "prefill_chunks")


@dataclass(frozen=True)
class StepComposition:
    """What one step computes.

    Attributes:
        decode_contexts: context length of each decode, its new token included (tokens).
        prefill_chunks: (tokens in the chunk, start position) of each prefill chunk.
    """

    decode_contexts: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, out) -> "StepComposition":
        """From a :class:`~sloserve.step_io.SchedulerOutput` (its ``composition()``)."""
        return cls(*out.composition())

    def features(self) -> np.ndarray:
        """The model's feature vector (see the module docstring), float64 of shape (6,)."""
        return np.array([
            1.0,
            len(self.decode_contexts),
            sum(self.decode_contexts),
            sum(n for n, _ in self.prefill_chunks),
            sum(n * (s + n) for n, s in self.prefill_chunks),
            len(self.prefill_chunks),
        ], dtype=np.float64)


class CostModel(Protocol):
    """Anything that prices a step (seconds)."""

    def step_time(self, comp: StepComposition) -> float: ...


@dataclass
class LinearCostModel:
    """The profiled cost model: ``t = coef . features`` (seconds; coefficients per feature in
    :data:`FEATURES` order: s, s/decode, s/context token, s/prefill token, s/attention pair,
    s/chunk). Five coefficients (a profile written before the per-chunk term) get a zero one.

    Raises:
        ValueError: not a list of 5 or 6 coefficients, or one negative, infinite or NaN.
    """

    coef: list[float] = field(default_factory=lambda: [0.0] * len(FEATURES))

    def __post_init__(self) -> None:
        if not isinstance(self.coef, (list, tuple)):
            raise ValueError(f"coefficients must be a list of {len(FEATURES)} numbers, "
                             f"got {self.coef!r}")
        self.coef = list(self.coef)
        if len(self.coef) == len(FEATURES) - 1:
            self.coef.append(0.0)
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} coefficients ({', '.join(FEATURES)}), "
                             f"got {len(self.coef)}")
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < math.inf
                   for c in self.coef):
            raise ValueError(f"coefficients must be finite numbers >= 0, got {self.coef}")

    def step_time(self, comp: StepComposition) -> float:
        """Seconds of one step."""
        return float(np.dot(self.coef, comp.features()))

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepComposition, float]]) -> "LinearCostModel":
        """Non-negative least squares on (composition, measured seconds) pairs.

        Solved as ordinary least squares, then any negative coefficient is fixed at 0 and the
        rest refitted (a few features, so this active-set loop ends in at most 6 rounds).

        Raises:
            ValueError: fewer samples than features.
        """
        if len(samples) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} samples to fit, got {len(samples)}")
        x = np.stack([c.features() for c, _ in samples])
        y = np.array([t for _, t in samples], dtype=np.float64)
        active = list(range(len(FEATURES)))
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
        return cls([float(v) for v in coef])

    def relative_errors(self, samples: Sequence[tuple[StepComposition, float]]) -> np.ndarray:
        """|predicted - measured| / measured for each sample."""
        return np.array([abs(self.step_time(c) - t) / t for c, t in samples])


@dataclass
class OverlapCostModel:
    """A roofline-shaped step: memory and compute overlap, so a step costs the larger of the
    two. ``t = overhead + max(decode_step_s, prefill tokens / prefill_tokens_per_s)``.

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
        """Seconds of one step."""
        prefill = sum(n for n, _ in comp.prefill_chunks) / self.prefill_tokens_per_s
        return self.overhead_s + max(self.decode_step_s if comp.decode_contexts else 0.0, prefill)


@dataclass
class RooflineCostModel:
    """A step priced on the roofline (Williams et al. 2009) from the calculator's specs:
    ``t = overhead + max(FLOP / (peak x compute_eff), bytes / (bandwidth x memory_eff))``, per
    GPU under tensor parallelism ``tp`` (FLOP and bytes split evenly; communication not priced).

    FLOP and bytes come from :func:`sloserve.roofline.ops.operator_costs`: the weights are read
    once per step whatever it carries; every new token pays the linear layers' FLOP; a decode at
    context c reads c tokens of KV and does c attention pairs; a chunk of n tokens at start s
    reads s + n tokens of KV and does n * s + n (n + 1) / 2 pairs.

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
    _per: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        from sloserve.roofline.ops import Workload, operator_costs
        if self.tp < 1 or not (0 < self.compute_eff <= 1 and 0 < self.memory_eff <= 1):
            raise ValueError("tp must be >= 1 and efficiencies in (0, 1]")
        if not 0 <= self.overhead_s < math.inf:
            raise ValueError(f"overhead must be a finite number of seconds >= 0, got "
                             f"{self.overhead_s}")
        one = {o.name: o for o in operator_costs(self.spec, Workload("decode", 1, 1, self.dtype,
                                                                     self.dtype, self.dtype))}
        two = {o.name: o for o in operator_costs(self.spec, Workload("decode", 1, 2, self.dtype,
                                                                     self.dtype, self.dtype))}
        lin = [o for n, o in one.items() if n != "attention"]
        self._per = {
            "weights": sum(o.weight_bytes for o in one.values()),
            "token_flops": sum(o.flops for o in lin),
            "token_act_bytes": sum(o.act_bytes for o in one.values()),
            "pair_flops": two["attention"].flops - one["attention"].flops,
            "kv_token_bytes": two["attention"].kv_bytes - one["attention"].kv_bytes,
            "kv_write_bytes": one["qkv_proj"].kv_bytes,
        }

    def step_time(self, comp: StepComposition) -> float:
        """Seconds of one step."""
        p = self._per
        tokens = len(comp.decode_contexts) + sum(n for n, _ in comp.prefill_chunks)
        pairs = sum(comp.decode_contexts) + sum(n * s + n * (n + 1) // 2
                                                for n, s in comp.prefill_chunks)
        kv_tokens = sum(comp.decode_contexts) + sum(s + n for n, s in comp.prefill_chunks)
        flops = tokens * p["token_flops"] + pairs * p["pair_flops"]
        nbytes = (p["weights"] + tokens * (p["token_act_bytes"] + p["kv_write_bytes"])
                  + kv_tokens * p["kv_token_bytes"])
        peak = self.hw.peak(self.dtype) * self.compute_eff
        bw = self.hw.mem_bandwidth * self.memory_eff
        return self.overhead_s + max(flops / peak, nbytes / bw) / self.tp
