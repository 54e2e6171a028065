"""Model drafts for speculative decoding, in the worker (``layer_skip`` and ``draft_model``):
the engine core proposes :data:`~sloserve.step_io.DRAFT_PLACEHOLDER` tokens, the scheduler
places them (and allocates their KV slots), and before the verify pass the runner asks the
:class:`ModelDrafter` to fill them in, k autoregressive passes over the drafting requests.

* ``layer_skip``: the served model's first ``num_draft_layers`` layers, its final norm and LM
  head (early exit). Its passes write those layers' KV at the draft positions into the served
  model's cache, where the verify pass then overwrites them; the full steps have already written
  those layers' KV for every earlier position, so it needs no cache of its own.
* ``draft_model``: a second model with the same vocabulary and its own KV cache tensors indexed
  by the same block tables (each block holds both models' KV for the same tokens, so preemption,
  prefix caching and rollback need nothing more). It runs over every token the step computes
  (prompt chunks too) before drafting; a draft it never saw because every draft of the step was
  accepted is fed at the request's next step.

Drafts are the draft logits' argmax (``greedy``) or, for a request that samples, a sample of the
draft's distribution q at the request's temperature, top-k and top-p (``probabilistic``); the
runner then verifies those with :func:`~sloserve.model.rejection_sampler.rejection_sample`.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from sloserve.model.runner import build_step_inputs
from sloserve.model.sampler import STREAM_DRAFT, Sampler, draw
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import DRAFT_PLACEHOLDER, ScheduledRequest, SchedulerOutput


@dataclasses.dataclass
class Drafts:
    """What :meth:`ModelDrafter.draft` made of a step."""

    #: the step with its placeholders replaced by the drafts
    out: SchedulerOutput
    #: per scheduled request, its drafts (empty where it had no placeholders)
    token_ids: list[list[int]]
    #: per scheduled request, [k, V] draft probabilities of a probabilistic draft, else None
    probs: list[torch.Tensor | None]
    seconds: float = 0.0


class ModelDrafter:
    """Args:
        model: the model that drafts (the served one for ``layer_skip``).
        kv_caches: its KV cache tensors, one per layer.
        num_layers: layers it runs (``layer_skip``), None: all.
        attn_backend: the attention backend (the served model's: same layout).
        block_size: tokens per KV block.
        sampler: the runner's sampler (the requests' generators, processed logits).
        probabilistic: sample drafts from q (``draft_sample_method: probabilistic``).
        catch_up: the drafter runs over every token of every step (``draft_model``).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], num_layers: int | None,
                 attn_backend, block_size: int, sampler: Sampler, probabilistic: bool,
                 catch_up: bool):
        self.model, self.kv_caches, self.num_layers = model, kv_caches, num_layers
        self.attn_backend, self.block_size = attn_backend, block_size
        self.sampler, self.probabilistic, self.catch_up = sampler, probabilistic, catch_up
        #: draft_model: request -> (position, token) of an accepted draft the model has not run
        self._unseen: dict[str, tuple[int, int]] = {}

    def release(self, request_id: str) -> None:
        self._unseen.pop(request_id, None)

    # ------------------------------------------------------------------ one step
    def draft(self, out: SchedulerOutput) -> Drafts:
        t0 = time.perf_counter()
        n_req = len(out.scheduled)
        ks = [sum(1 for t in sr.spec_token_ids if t == DRAFT_PLACEHOLDER) for sr in out.scheduled]
        drafts: list[list[int]] = [[] for _ in range(n_req)]
        probs: list[list[torch.Tensor] | None] = [
            [] if k and self.probabilistic and not sr.sampling_params.greedy else None
            for k, sr in zip(ks, out.scheduled)]
        # the first pass: each drafting request's last sampled token (and, for a draft model,
        # every other token the step computes, and any accepted draft it has not run)
        first: list[ScheduledRequest] = []
        rows: list[int] = []  # scheduled index of each drafting request, in pass order
        for i, (sr, k) in enumerate(zip(out.scheduled, ks)):
            n = sr.num_new_tokens - k
            start, toks = sr.num_computed_tokens, list(sr.token_ids[:n])
            if self.catch_up:
                seen = self._unseen.pop(sr.request_id, None)
                if seen is not None and seen[0] == start - 1:
                    start, toks = start - 1, [seen[1]] + toks
                first.append(dataclasses.replace(
                    sr, num_computed_tokens=start, num_new_tokens=len(toks), token_ids=toks,
                    samples=bool(k), spec_token_ids=[], prompt_logprob_targets=[],
                    token_bitmask=[]))
            elif k:
                first.append(self._one(sr, start, toks[-1]))
            if k:
                rows.append(i)
        if first:
            logits = self._forward(SchedulerOutput(scheduled=first))
            self._take(logits, rows, out, drafts, probs)
        for j in range(1, max(ks, default=0)):
            live = [i for i in rows if ks[i] > j]
            if not live:
                break
            step = [self._one(out.scheduled[i], out.scheduled[i].num_computed_tokens + j,
                              drafts[i][-1]) for i in live]
            logits = self._forward(SchedulerOutput(scheduled=step))
            self._take(logits, live, out, drafts, probs)
        filled = []
        for sr, k, d in zip(out.scheduled, ks, drafts):
            if k:
                n = sr.num_new_tokens - k
                sr = dataclasses.replace(sr, token_ids=list(sr.token_ids[:n]) + d,
                                         spec_token_ids=d)
            filled.append(sr)
        return Drafts(dataclasses.replace(out, scheduled=filled), drafts,
                      [None if p is None else torch.stack(p) for p in probs],
                      time.perf_counter() - t0)

    @torch.inference_mode()
    def measure_pass_cost(self, runner, context: int = 256, repeats: int = 9) -> float:
        """One draft pass of a one-token decode over the served model's decode step (medians
        of ``repeats``, interleaved, after a warm-up): what each draft token adds to a step
        (``WorkerInfo.draft_pass_cost``). Writes KV in the first blocks: call it before any
        request runs."""
        bs = self.block_size
        context = min(context, runner.num_blocks * bs - 1)
        sr = ScheduledRequest("draft-cost", context, 1, [0], list(range(context // bs + 1)),
                              SamplingParams(), samples=True, is_decode=True,
                              num_prompt_tokens=1)
        inputs = build_step_inputs(SchedulerOutput([sr]), bs)
        target, draft = [], []
        for r in range(repeats + 1):
            for model, caches, layers, times in (
                    (runner.model, runner.kv_caches, None, target),
                    (self.model, self.kv_caches, self.num_layers, draft)):
                t0 = time.perf_counter()
                meta = self.attn_backend.build_metadata(inputs)
                model(inputs.input_ids, inputs.positions, caches, self.attn_backend, meta,
                      inputs.logits_indices, layers)
                if r:
                    times.append(time.perf_counter() - t0)
        return sorted(draft)[repeats // 2] / sorted(target)[repeats // 2]

    def after_verify(self, sr: ScheduledRequest, kept: list[int]) -> None:
        """A draft model that has not run the last draft of a fully accepted run runs it next
        step (its position and token)."""
        k = len(sr.spec_token_ids)
        if self.catch_up and k and len(kept) == k + 1:
            self._unseen[sr.request_id] = (sr.num_computed_tokens + k, sr.spec_token_ids[-1])

    def _one(self, sr: ScheduledRequest, pos: int, tok: int) -> ScheduledRequest:
        """A one-token decode of ``sr`` at position ``pos``."""
        return dataclasses.replace(sr, num_computed_tokens=pos, num_new_tokens=1,
                                   token_ids=[tok], samples=True, is_decode=True,
                                   spec_token_ids=[], prompt_logprob_targets=[],
                                   token_bitmask=[])

    def _forward(self, step: SchedulerOutput) -> torch.Tensor:
        inputs = build_step_inputs(step, self.block_size)
        meta = self.attn_backend.build_metadata(inputs)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.attn_backend,
                          meta, inputs.logits_indices, self.num_layers)

    def _take(self, logits: torch.Tensor, rows: list[int], out: SchedulerOutput,
              drafts: list[list[int]], probs: list) -> None:
        """Append one draft token per request in ``rows`` (one logits row each, in order):
        the argmax, or for a probabilistic draft a sample of q (one uniform from the request's
        generator; the rows drawn together)."""
        sampled = []
        for r, i in enumerate(rows):
            if probs[i] is None:
                drafts[i].append(int(logits[r].argmax()))
            else:
                sampled.append((r, i))
        if not sampled:
            return
        srs = [out.scheduled[i] for _, i in sampled]
        params = [sr.sampling_params for sr in srs]
        q = self.sampler.probs(logits[[r for r, _ in sampled]], params)
        # the draft at token index n + 1 + (drafts so far): its own stream of the request's
        u = self.sampler.uniforms([sr.request_id for sr in srs], params,  # uniforms
                                  [sr.num_computed_tokens + 1 + len(drafts[i])
                                   for sr, (_, i) in zip(srs, sampled)], STREAM_DRAFT)
        for (r, i), qi, t in zip(sampled, q, draw(q, u).tolist()):
            drafts[i].append(t)
            probs[i].append(qi)
