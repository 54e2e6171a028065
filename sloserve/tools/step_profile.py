"""Time engine steps of a known composition: pure decode batches, single-step prefills, and
decodes mixed with a prefill chunk.

One place for the step-driving logic that `benchmarks/engine_bench.py`, `sloserve roofline
--measure` and the simulator's grid profile (`sloserve profile`) need. Decode and prefill steps
run through the whole engine (`LLMEngine.step`); mixed steps run on the model runner alone. Times are seconds
(perf_counter); `forward_s`/`prepare_s`/`sample_s` are the model runner's own timings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from sloserve.engine.llm_engine import LLMEngine
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class StepSample:
    """One timed engine step.

    Attributes:
        wall_s: the whole `step()` (schedule, prepare, forward, sample, update, detokenize).
        prepare_s, forward_s, sample_s: the runner's phases.
        context: decode only: tokens in each sequence's cache after the step (new one included).
    """

    wall_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    context: int | None = None


def synthetic_prompt(n: int, seed: int, vocab: int) -> list[int]:
    """`n` deterministic token ids in [10, min(vocab, 1000)) (no special tokens for real vocabularies)."""
    hi = max(2, min(vocab, 1000) - 10)
    return [(7 * seed + 13 * j) % hi + 10 if hi > 10 else (seed + j) % hi for j in range(n)]


def _timed_step(eng: LLMEngine, context: int | None = None) -> StepSample:
    t0 = time.perf_counter()
    eng.step()
    wall = time.perf_counter() - t0
    tm = eng.core.last_runner_output
    return StepSample(wall, tm.prepare_s, tm.forward_s, tm.sample_s, context)


def start_decodes(eng: LLMEngine, batch: int, prompt_len: int, max_tokens: int) -> list[str]:
    """Add `batch` greedy ignore-EOS requests of `prompt_len` tokens and step (untimed) until
    none is waiting or prefilling. Returns their ids."""
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(synthetic_prompt(prompt_len, 1000 * batch + i, vocab), sp)
           for i in range(batch)]
    while eng.scheduler.waiting or any(r.is_prefilling for r in eng.scheduler.running):
        eng.step()
    return ids


def time_decode_steps(eng: LLMEngine, batch: int, context_len: int, warmup: int,
                      repeats: int, spec_tokens: int = 0) -> list[StepSample]:
    """`repeats` timed pure-decode steps of exactly `batch` sequences, centred on `context_len`.

    The prompts are prefilled first (untimed); for all sequences to start decoding together the
    engine's token budget must hold batch x context_len tokens. The requests are aborted after.
    `spec_tokens` > 0: verify steps, each sequence with that many draft tokens (the vocabulary's
    last id, which the greedy model does not pick: all rejected, so the context still grows by
    one per step; the engine's own drafter is off meanwhile).

    Raises:
        ValueError: context_len too short for warmup + repeats.
        RuntimeError: a timed step was not a pure decode of `batch` sequences at one context.
    """
    prompt = context_len - 1 - warmup - (repeats - 1) // 2
    if prompt < 1:
        raise ValueError(f"context length {context_len} too short for warmup {warmup} + {repeats} repeats")
    ids = start_decodes(eng, batch, prompt, warmup + repeats + 4)
    out = []
    drafter, eng.core.drafter = eng.core.drafter, None
    for k in range(warmup + repeats):
        running = eng.scheduler.running
        for r in running:
            r.spec_token_ids = [eng.model_config.vocab_size - 1] * spec_tokens
        if len(running) != batch or any(r.is_prefilling for r in running):
            raise RuntimeError(f"decode batch {batch}: step {k} is not a pure decode of {batch} sequences")
        ctx = {r.num_tokens for r in running}
        if len(ctx) != 1:
            raise RuntimeError(f"decode batch {batch}: sequences at different contexts {sorted(ctx)}")
        s = _timed_step(eng, ctx.pop())
        if k >= warmup:
            out.append(s)
    eng.core.drafter = drafter
    for rid in ids:
        eng.abort_request(rid)
    return out


def time_prefill_steps(eng: LLMEngine, n: int, warmup: int, repeats: int) -> list[StepSample]:
    """`repeats` timed steps that each prefill one fresh `n`-token prompt whole (batch 1).

    Raises:
        RuntimeError: the prompt did not fit one step (token budget below `n`).
    """
    vocab = eng.model_config.vocab_size
    out = []
    for r in range(warmup + repeats):
        rid = eng.add_request(synthetic_prompt(n, 7919 * n + r, vocab),
                              SamplingParams(temperature=0.0, max_tokens=1))
        req = eng.scheduler.requests[rid]
        s = _timed_step(eng)
        if req.num_computed_tokens < n:
            raise RuntimeError(f"prefill {n}: the prompt was not run in one step")
        if r >= warmup:
            out.append(s)
        while eng.has_unfinished_requests():
            eng.step()
    return out


def time_mixed_steps(eng: LLMEngine, batch: int, context_len: int, chunk: int, warmup: int,
                     repeats: int) -> list[StepSample]:
    """`repeats` timed steps of `batch` decodes plus one prefill chunk of exactly `chunk` tokens
    (Sarathi-Serve's hybrid batch; `chunk` = 0: pure decode steps), run on the engine's model
    runner as plain-data scheduler outputs.

    Step k (warm-up included) has decodes at context ``context_len + k + 1`` and a chunk at
    positions ``chunk * k .. chunk * (k + 1) - 1`` of one prompt, what the chunked scheduler
    builds with a budget of batch + chunk. The scheduler is not involved, so no budget has to
    be bent and any composition can be timed; ``wall_s`` is the runner's whole ``execute``
    (inputs, forward, sampling), without the scheduler's own ~1 ms. The blocks are the
    engine's; what they hold does not change the cost.

    Raises:
        ValueError: the engine has requests in flight (their KV would be overwritten), or its
            cache has too few blocks for the composition.
    """
    if eng.has_unfinished_requests():
        raise ValueError("time_mixed_steps needs an idle engine (its blocks are used directly)")
    steps = warmup + repeats
    bs = eng.config.block_size
    per_decode = -(-(context_len + steps) // bs)
    need = batch * per_decode + -(-chunk * steps // bs)
    if need > eng.num_kv_blocks:
        raise ValueError(f"{batch} decodes at context {context_len} + a {chunk}-token chunk "
                         f"for {steps} steps need {need} KV blocks; the engine has "
                         f"{eng.num_kv_blocks}")
    vocab = eng.model_config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    tables = [list(range(i * per_decode, (i + 1) * per_decode)) for i in range(batch)]
    chunk_blocks = list(range(batch * per_decode, need))
    prompt = synthetic_prompt(chunk * steps, 4242 + chunk, vocab)
    out = []
    for k in range(steps):
        ctx = context_len + k + 1
        sched = [ScheduledRequest(f"profile-d{i}", ctx - 1, 1, [10 + i], tables[i], greedy,
                                  samples=True, is_decode=True) for i in range(batch)]
        if chunk:
            sched.append(ScheduledRequest("profile-p", chunk * k, chunk,
                                          prompt[chunk * k:chunk * (k + 1)], chunk_blocks, greedy,
                                          samples=False, is_decode=False))
        t0 = time.perf_counter()
        ro = eng.runner.execute(SchedulerOutput(sched))
        wall = time.perf_counter() - t0
        if k >= warmup:
            out.append(StepSample(wall, ro.prepare_s, ro.forward_s, ro.sample_s, ctx))
    return out
