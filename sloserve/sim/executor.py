"""The simulator's executor: the engine core's seam (``sloserve.executor``) with a step cost model
behind it instead of workers, and the virtual clock the core reads.

:class:`CostModelExecutor` loads no model and holds no KV tensors: it tells the core the shape
it stands for (a KV cache spec, the number of blocks), prices each
:class:`~sloserve.step_io.SchedulerOutput` with a :class:`~sloserve.sim.cost_model.CostModel`,
advances the :class:`VirtualClock` by that many seconds and returns a plain
:class:`~sloserve.step_io.ModelRunnerOutput` with one stand-in token (id 1) for every request
whose chunk samples. How long an output runs is the request's ``max_tokens`` (``ignore_eos``),
which the simulator sets. No torch.

Speculative decoding is modelled, not run: :class:`SimDrafter` is the engine's own
:class:`~sloserve.spec_decode.drafter.Drafter` (its k per batch size, ``Drafter.k_for``, and its
acceptance floor) proposing k stand-in tokens for every candidate, whatever the method; the
executor accepts draft position i with probability ``spec_acceptance_rate`` given that every
earlier one was accepted (a seeded RNG) and returns the accepted drafts plus one token, as the
real runner returns them. The methods whose drafts come from a model (``draft_model``,
``layer_skip``) are modelled the same way: their drafting passes are not priced, only the
verify step's extra query tokens (the cost model's ``draft_tokens`` and ``dense_step`` terms).
"""
from __future__ import annotations

import dataclasses
import math
import random
from functools import lru_cache
from typing import Any, Callable

from sloserve.config import MODEL_SPEC_METHODS, EngineConfig, SpeculativeConfig
from sloserve.executor.abstract import Executor
from sloserve.kv_cache_spec import KVCacheSpec
from sloserve.sim.cost_model import CostModel, StepComposition
from sloserve.spec_decode.drafter import Drafter
from sloserve.step_io import VERIFY_COST_TOKENS, ModelRunnerOutput, SchedulerOutput, WorkerInfo

#: the longest step a cost model may price (s): longer is a settings mistake, not a server
MAX_STEP_S = 3600.0
#: the token id every sampled position gets (the content does not matter to scheduling)
SAMPLED_TOKEN_ID = 1


class VirtualClock:
    """Simulated seconds: the engine core reads it in place of ``time.monotonic()``.

    The event loop sets it when an idle engine starts a step (:meth:`set`); the executor
    advances it by the step's modelled time (:meth:`advance`), so the core stamps the step's
    outputs with the time the step ends.
    """

    __slots__ = ("time",)

    def __init__(self, start: float = 0.0):
        self.time = start

    def __call__(self) -> float:
        return self.time

    def set(self, t: float) -> None:
        """Move to ``t``. Raises ValueError: ``t`` is before the clock's time."""
        if t < self.time:
            raise ValueError(f"the virtual clock cannot go back from {self.time!r} to {t!r} s")
        self.time = t

    def advance(self, dt: float) -> float:
        """Move ``dt`` seconds on; returns the new time."""
        self.time = self.time + dt
        return self.time


@lru_cache(maxsize=None)
def default_kv_cache_spec(block_size: int) -> KVCacheSpec:
    """The KV cache spec of the embedded SmolLM2 in bf16 (what ``SimConfig``'s default block
    count is sized for)."""
    from sloserve.roofline.kv import kv_cache_spec
    from sloserve.roofline.models import get_model
    return kv_cache_spec(get_model("SmolLM2-135M"), "bf16", block_size)


def verify_cost(cost: CostModel, context: int = 64) -> list[float]:
    """What the worker measures at start-up (``WorkerInfo.verify_cost``), priced by ``cost``:
    a step of one request with T query tokens over a one-token decode, for each T of
    ``VERIFY_COST_TOKENS``; the simulated drafter takes its k per batch size from it."""
    decode = cost.step_time(StepComposition((context + 1,)))
    return [cost.step_time(StepComposition((context + t,), (), (t - 1,))) / decode
            for t in VERIFY_COST_TOKENS]


class SimDrafter(Drafter):
    """The engine's drafter with stand-in drafts: the same k per batch size
    (:meth:`~sloserve.spec_decode.drafter.Drafter.k_for`, with the simulated worker's quantized
    step limit) and the same acceptance floor (``min_acceptance_rate``), but every proposal is
    k tokens of :data:`SAMPLED_TOKEN_ID` (the n-gram or suffix match is not looked for: the
    executor's acceptance rate stands for how often drafts are right). Set as the core's
    ``drafter`` after the core is built (the simulator does, ``Replica``).

    Args:
        config: the speculative config (``--speculative-config``).
        quantized_step_max_tokens: the simulated worker's step limit (the cost model's).
    """

    def __init__(self, config: SpeculativeConfig, quantized_step_max_tokens: int = 0,
                 verify_cost: list[float] | None = None):
        # as a model method: no proposer is built, propose() gives placeholders of the right
        # count after the k and floor rules, finish() drops only the floor's state (and the
        # core, seeing config.uses_model, offers it no grammar request: the simulator has none)
        model = config if config.method in MODEL_SPEC_METHODS else \
            dataclasses.replace(config, method=MODEL_SPEC_METHODS[0])
        super().__init__(model, quantized_step_max_tokens, verify_cost)
        self.method = config.method

    def propose(self, request_id: str, token_ids, num_prompt_tokens: int, max_drafts: int,
                batch_size: int = 1) -> list[int]:
        """k stand-in tokens (k as the engine's drafter decides it; [] where it would draft
        none)."""
        n = len(super().propose(request_id, token_ids, num_prompt_tokens, max_drafts,
                                batch_size))
        return [SAMPLED_TOKEN_ID] * n


class CostModelExecutor(Executor):
    """An executor whose step is a price: no workers, no model.

    Args:
        config: the simulated engine's settings (``num_kv_blocks`` set: the cache it has).
        cost: prices a step's composition (seconds).
        clock: the core's clock; each step advances it by the step's price.
        max_model_len: the context the simulated model has (tokens).
        kv_cache_spec: the KV layout the blocks stand for (default: the embedded SmolLM2 in
            bf16, :func:`default_kv_cache_spec`).
        on_step: called with (end time, composition) after each step is priced.
        on_execute: called with (scheduler output, start time, end time) of each step, before
            the core's update sees its tokens (and frees the blocks of the requests it
            finishes): the simulator's look at which requests a step computes.
        spec_acceptance_rate: the chance that a draft token is accepted given that every draft
            before it in the step was (0 to 1; speculative decoding, see the module docstring).
        seed: seeds the acceptance draws.

    Raises (constructor):
        ValueError: ``config.num_kv_blocks`` unset, a spec whose block size is not the
            config's, an acceptance rate outside [0, 1].
    """

    def __init__(self, config: EngineConfig, cost: CostModel, clock: VirtualClock,
                 max_model_len: int, kv_cache_spec: KVCacheSpec | None = None,
                 on_step: Callable[[float, StepComposition], None] | None = None,
                 spec_acceptance_rate: float = 0.0, seed: int = 0,
                 on_execute: Callable[[SchedulerOutput, float, float], None] | None = None):
        if config.num_kv_blocks is None:
            raise ValueError("the cost-model executor needs num_kv_blocks")
        if not (isinstance(spec_acceptance_rate, (int, float))
                and math.isfinite(spec_acceptance_rate) and 0 <= spec_acceptance_rate <= 1):
            raise ValueError(f"the draft acceptance rate must be in [0, 1], got "
                             f"{spec_acceptance_rate!r}")
        self.cost, self.clock, self.on_step, self.on_execute = cost, clock, on_step, on_execute
        self.spec_acceptance_rate = float(spec_acceptance_rate)
        self.rng = random.Random(seed)
        self.max_model_len = max_model_len
        self.kv_cache_spec = kv_cache_spec or default_kv_cache_spec(config.block_size)
        if self.kv_cache_spec.block_size != config.block_size:
            raise ValueError(f"KV cache spec block size {self.kv_cache_spec.block_size} is not "
                             f"the engine's {config.block_size}")
        self.num_blocks = 0
        super().__init__(config)

    def _init_executor(self) -> None:
        """Nothing to start: no device, no model."""

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        raise NotImplementedError(f"the cost-model executor has no workers to call {method!r} on")

    def get_model_info(self) -> WorkerInfo:
        from sloserve.model.config import ModelConfig
        spec = self.kv_cache_spec
        mc = ModelConfig(num_hidden_layers=spec.num_layers,
                         max_position_embeddings=self.max_model_len)
        return WorkerInfo(model_name="simulated", model_path="", model_config=mc,
                          dtype=spec.dtype, kv_cache_dtype=spec.dtype,
                          description=f"cost model {type(self.cost).__name__}",
                          quantized_step_max_tokens=getattr(self.cost,
                                                            "quantized_step_max_tokens", 0))

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.kv_cache_spec

    def determine_available_memory(self) -> int:
        return int(self.config.num_kv_blocks * self.kv_cache_spec.page_size_bytes)

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Price the step, advance the clock by it, sample a stand-in token where one is due
        (after a decode's k drafts: the accepted ones, drawn position by position, plus one).

        Raises:
            ValueError: the cost model priced the step at <= 0 s, over :data:`MAX_STEP_S` or NaN.
        """
        comp = StepComposition.of(scheduler_output)
        dt = self.cost.step_time(comp)
        if not 0 < dt <= MAX_STEP_S:  # also catches NaN
            raise ValueError(f"the cost model priced a step at {dt!r} s ({comp}); a step must "
                             f"take more than 0 and at most {MAX_STEP_S:g} s: check its settings")
        end = self.clock.advance(dt)
        if self.on_step is not None:
            self.on_step(end, comp)
        if self.on_execute is not None:
            self.on_execute(scheduler_output, end - dt, end)
        scheduled = scheduler_output.scheduled
        return ModelRunnerOutput(
            req_ids=[sr.request_id for sr in scheduled],
            sampled_token_ids=[self._sampled(sr.spec_token_ids) if sr.samples else []
                               for sr in scheduled],
            forward_s=dt)

    def _sampled(self, drafts: list[int]) -> list[int]:
        """The accepted prefix of ``drafts`` (position i accepted with the acceptance rate
        while all before it were) and one sampled token; no draw without drafts."""
        a = 0
        while a < len(drafts) and self.rng.random() < self.spec_acceptance_rate:
            a += 1
        return [*drafts[:a], SAMPLED_TOKEN_ID]

    def shutdown(self) -> None:
        """Nothing to stop."""
