"""Model runner: owns the paged KV cache tensors and turns a scheduler output (plain data) into one
forward pass and the sampled tokens.

It imports no scheduler: it reads a :class:`~sloserve.step_io.SchedulerOutput` and returns a
:class:`~sloserve.step_io.ModelRunnerOutput`. It builds backend-neutral
:class:`~sloserve.model.attention.StepInputs`; the attention backend builds its own metadata from
them and owns the KV layout. KV blocks can be exported to a contiguous buffer and imported into
other blocks (:meth:`ModelRunner.export_kv` / :meth:`ModelRunner.import_kv`): the seam for a KV
connector (prefill/decode disaggregation) and for offloading cached prefixes.
"""
from __future__ import annotations

import time

import torch

from sloserve.kv_cache_spec import KVCacheSpec
from sloserve.model.attention import AttentionBackend, StepInputs
from sloserve.model import hugepages
from sloserve.model.config import ModelConfig
from sloserve.model import logprobs as lp
from sloserve.model.invariant import one_thread
from sloserve.model.rejection_sampler import rejection_sample
from sloserve.model.sampler import (STREAM_ACCEPT, STREAM_SAMPLE, UNSAMPLEABLE, Sampler,
                                    apply_token_bitmask)
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import (DRAFT_PLACEHOLDER, VERIFY_COST_TOKENS, ModelRunnerOutput,
                              ScheduledRequest, SchedulerOutput)


def kv_cache_spec(config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype) -> KVCacheSpec:
    """The model's KV cache spec (``sloserve.kv_cache_spec``: bytes per token and block, the
    entry width of an int8 cache) for blocks of ``block_size`` tokens in ``kv_cache_dtype``."""
    return KVCacheSpec(block_size=block_size, num_kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim,
                       dtype=str(kv_cache_dtype).removeprefix("torch."),
                       num_layers=config.num_hidden_layers)


def build_step_inputs(out: SchedulerOutput, block_size: int) -> StepInputs:
    """Flatten a step: every scheduled request's query tokens in order (backend-neutral).

    Logits are needed at the last query token of each request whose chunk samples, and for a
    verify step at each of its 1 + k last positions (the token after its last sampled one, then
    one after each draft token); for a request that asked for prompt logprobs also at its
    chunk's first ``len(prompt_logprob_targets)`` positions, which come first in its rows.

    Raises:
        ValueError: a request's token ids, positions or block table do not fit.
    """
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_idx: list[int] = []
    qsl = [0]
    qlens, seqs, done = [], [], []
    for sr in out.scheduled:
        n, start = sr.num_new_tokens, sr.num_computed_tokens
        end = start + n
        table = sr.block_ids
        if len(sr.token_ids) != n or len(table) * bs < end:
            raise ValueError(f"{sr.request_id}: {len(sr.token_ids)} token ids and "
                             f"{len(table)} blocks for positions {start}..{end - 1}")
        t0 = len(input_ids)
        input_ids += sr.token_ids
        positions += range(start, end)
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        m = len(sr.prompt_logprob_targets)
        if m > n:
            raise ValueError(f"{sr.request_id}: {m} prompt logprob targets for {n} positions")
        logits_idx += range(t0, t0 + m)
        if sr.samples:
            k = len(sr.spec_token_ids)
            logits_idx += range(t0 + n - 1 - k, t0 + n)
        qsl.append(len(input_ids))
        qlens.append(n)
        seqs.append(end)
        done.append(start)
    nmax = max((-(-e // bs) for e in seqs), default=0)
    table = torch.zeros(len(seqs), nmax, dtype=torch.long)
    for b, sr in enumerate(out.scheduled):
        row = sr.block_ids[:-(-seqs[b] // bs)]
        table[b, :len(row)] = torch.tensor(row, dtype=torch.long)
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.long),
        seq_lens=torch.tensor(seqs, dtype=torch.long),
        num_computed_tokens=torch.tensor(done, dtype=torch.long),
        block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.long),
        logits_indices=torch.tensor(logits_idx, dtype=torch.long), block_size=bs,
        query_lens=qlens, seq_lens_list=seqs, num_computed_list=done,
        prompt_lens=[sr.num_prompt_tokens for sr in out.scheduled])


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        model: a LlamaForCausalLM, its ops chosen (``sloserve.model.model_loader``), or any
            module with its forward signature.
        config: the model's config.
        num_blocks, block_size: the KV cache (blocks x tokens per block).
        kv_cache_dtype: dtype of the cache tensors.
        sampler: picks the next tokens.
        attn_backend: computes attention; its ``kv_cache_shape`` lays out the cache, one tensor
            per layer, allocated once.
        logprobs_mode: what logprobs report (``--logprobs-mode``, see sloserve.model.logprobs).
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int,
                 block_size: int, kv_cache_dtype: torch.dtype, sampler: Sampler,
                 attn_backend: AttentionBackend,
                 logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.sampler = sampler
        self.attn_backend = attn_backend
        self.logprobs_mode = logprobs_mode
        #: the cache's layout and sizes (the worker sized the block count with the same spec)
        self.kv_cache_spec = spec = kv_cache_spec(config, block_size, kv_cache_dtype)
        self.kv_caches = self.allocate_kv(config, num_blocks, block_size, kv_cache_dtype,
                                          attn_backend)
        #: bytes of K and V of one token over all layers, in the cache's dtype
        self.kv_bytes_per_token = spec.bytes_per_token
        #: speculative decoding's model drafts (``sloserve.model.draft.ModelDrafter``), or None
        self.drafter = None
        #: the KV connector's worker half (``sloserve.kv_transfer.worker_side``), or None
        self.kv_connector = None

    @staticmethod
    def allocate_kv(config: ModelConfig, num_blocks: int, block_size: int,
                    kv_cache_dtype: torch.dtype, attn_backend) -> list[torch.Tensor]:
        """A model's KV cache tensors, one per layer in ``attn_backend``'s layout, on 2 MB
        pages where the OS allows (see hugepages: a decode step streams the cache), zero (the
        OS's pages) and committed in the background, all but the first layer's
        (:func:`hugepages.populate_in_background`: start-up does not wait for ~1 s of page
        faults; the size was fitted to the memory left, ``determine_available_memory``)."""
        spec = kv_cache_spec(config, block_size, kv_cache_dtype)
        shape = attn_backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads,
                                            spec.entry_width)
        kv = [hugepages.zeros(shape, kv_cache_dtype, touch=False)
              for _ in range(config.num_hidden_layers)]
        hugepages.populate_in_background(kv)
        return kv

    @torch.inference_mode()
    def measure_verify_cost(self, context: int = 256, repeats: int = 9) -> list[float]:
        """What a step of one greedy request past its prompt with T query tokens (a decode and
        T - 1 draft rows, all rejected) costs over a one-token decode, for each T of
        ``VERIFY_COST_TOKENS``: the median of ``repeats`` steps each (:meth:`execute`: inputs,
        forward, sampling; the token counts interleaved, after one warm-up round), never below
        a smaller T's (``context``: tokens before the step, fewer where the cache is smaller).
        It writes the KV of positions below ``context + 16`` in the first blocks: call it
        before any request runs (the worker does, at start-up, where
        speculative decoding is on)."""
        bs = self.block_size
        context = min(context, self.num_blocks * bs - max(VERIFY_COST_TOKENS))  # a small cache
        if context < 1:
            raise ValueError(f"{self.num_blocks} KV blocks are too few to time a step")
        steps = []
        for n in VERIFY_COST_TOKENS:
            blocks = list(range(-(-(context + n) // bs)))
            # drafts no argmax matches (vocab_size is no token id; the inputs are token 0)
            steps.append(SchedulerOutput([ScheduledRequest(
                "verify-cost", context, n, [0] * n, blocks,
                SamplingParams(temperature=0.0), samples=True, is_decode=True,
                spec_token_ids=[self.config.vocab_size] * (n - 1), num_prompt_tokens=1)]))
        runs: list[list[float]] = [[] for _ in steps]
        for r in range(repeats + 1):
            for out, times in zip(steps, runs):
                t0 = time.perf_counter()
                self.execute(out)
                if r:
                    times.append(time.perf_counter() - t0)
        med = [sorted(t)[len(t) // 2] for t in runs]
        out, top = [], 1.0
        for m in med:
            top = max(top, m / med[0])
            out.append(top)
        return out

    @torch.inference_mode()
    def prewarm_weights(self, part: int, parts: int) -> None:
        """Read part ``part`` (0-based) of ``parts`` of the weights a decode step streams (the
        packed quantized weights, else the parameters) and discard the result: a decode
        instance idle while a prompt's KV arrives does this, so that the request's first
        decode steps find the weights in the CPU's caches. (Where the last-level cache holds a
        small model's weights, the first steps after an idle spell took up to 1.8x a warm
        step, for 3-4 steps, on the AMX host of benchmarks/README.md.)"""
        buf = getattr(self.model, "decode_weights", None)
        if buf is not None:
            n = buf.numel() // 8
            lo, hi = n * part // parts, n * (part + 1) // parts
            buf[:n * 8].view(torch.int64)[lo:hi].sum()
            return
        for p in list(self.model.parameters())[part::parts]:
            p.detach().sum()

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, then sample.

        A request whose chunk samples gets one token; a verify step of k draft tokens gets the
        accepted drafts plus one: each of its k + 1 positions is sampled in order and the drafts
        are accepted while they equal the sampled token (greedy: exact; with sampling this is
        exact rejection sampling for a draft that proposes one token with certainty, as n-gram
        drafts do: accepted with probability p(draft), otherwise a sample of p without it).
        """
        for rid in out.finished_request_ids:
            self.sampler.release(rid)
            if self.drafter is not None:
                self.drafter.release(rid)
        t0 = time.perf_counter()
        drafts = None
        if self.drafter is not None and (self.drafter.catch_up or any(
                DRAFT_PLACEHOLDER in sr.spec_token_ids for sr in out.scheduled)):
            drafts = self.drafter.draft(out)
            out = drafts.out
        inputs = build_step_inputs(out, self.block_size)
        meta = self.attn_backend.build_metadata(inputs)
        conn = self.kv_connector
        hooks = None
        if conn is not None:
            conn.bind_connector_metadata(out)
            conn.start_load_kv()
            hooks = conn if conn.has_layer_work else None
        t1 = time.perf_counter()
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.attn_backend,
                         meta, inputs.logits_indices,
                         **({"layer_hooks": hooks} if hooks is not None else {}))
        if conn is not None:
            conn.wait_for_save()
        t2 = time.perf_counter()
        sampled, logprobs, prompt_logprobs, errors = self._sample(
            out, logits, drafts.probs if drafts is not None else None)
        if conn is not None:
            conn.after_sample(out, sampled)
        if drafts is not None:
            for sr, kept in zip(out.scheduled, sampled):
                if sr.request_id not in errors:
                    self.drafter.after_verify(sr, kept)
        t3 = time.perf_counter()
        draft_s = drafts.seconds if drafts is not None else 0.0
        return ModelRunnerOutput(req_ids=[s.request_id for s in out.scheduled],
                                 sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, prepare_s=t1 - t0 - draft_s,
                                 forward_s=t2 - t1 + draft_s, sample_s=t3 - t2,
                                 draft_token_ids=drafts.token_ids if drafts is not None else [],
                                 draft_s=draft_s,
                                 kv_connector_output=(conn.build_connector_output()
                                                      if conn is not None else None),
                                 errors=errors)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor,
                draft_probs: list[torch.Tensor | None] | None = None):
        """(sampled tokens, logprobs, prompt logprobs) per scheduled request from the logits
        rows of :func:`build_step_inputs` (each request's prompt rows, then its sample rows),
        and the requests whose rows could not be sampled (``ModelRunnerOutput.errors``).
        A request with draft probabilities (``draft_probs``: a probabilistic model draft) is
        verified by rejection sampling, the others by sample-and-match."""
        draft_probs = draft_probs or [None] * len(out.scheduled)
        sample_rows: list[int] = []
        rids, params = [], []
        plain: list[int] = []  # positions in sample_rows the sampler draws
        indices: list[int] = []  # the token index each of those samples
        prompt_rows: list[tuple[int, int]] = []  # (first row, count) per request
        mask_rows, masks = [], []
        row = 0
        starts: list[int] = []  # per scheduled request, its first row in sample_rows
        for sr, q in zip(out.scheduled, draft_probs):
            m = len(sr.prompt_logprob_targets)
            prompt_rows.append((row, m))
            row += m
            starts.append(len(sample_rows))
            if sr.samples:
                k1 = 1 + len(sr.spec_token_ids)
                for j in range(k1):
                    if j < len(sr.token_bitmask) and sr.token_bitmask[j]:
                        mask_rows.append(len(sample_rows))
                        masks.append(sr.token_bitmask[j])
                    if q is None:
                        plain.append(len(sample_rows))
                    sample_rows.append(row + j)
                if q is None:
                    rids += [sr.request_id] * k1
                    params += [sr.sampling_params] * k1
                    # the token each row samples: index end - k + j of the request's sequence
                    indices += range(sr.end_pos - k1 + 1, sr.end_pos + 1)
                row += k1
        if row != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows for {row} positions")
        slogits = logits if len(sample_rows) == row else logits[sample_rows]
        apply_token_bitmask(slogits, mask_rows, masks)
        toks = [0] * len(sample_rows)
        if rids:
            sub = slogits if len(plain) == len(sample_rows) else slogits[plain]
            for i, t in zip(plain, self.sampler(sub, rids, params, indices)):
                toks[i] = t
        verified = self._rejection_sample(out, slogits, draft_probs, starts)
        sampled: list[list[int]] = []
        logprobs: list = []
        prompt_logprobs: list = []
        errors: dict[str, str] = {}
        want_lp = any(sr.sampling_params.logprobs is not None for sr in out.scheduled)
        want_plp = any(m for _, m in prompt_rows)
        i = 0
        for sr, (r0, m) in zip(out.scheduled, prompt_rows):
            if want_plp:
                prompt_logprobs.append(self._logprobs(
                    sr.sampling_params, logits[r0:r0 + m], sr.prompt_logprob_targets,
                    sr.sampling_params.prompt_logprobs or 0) if m else None)
            if not sr.samples:
                sampled.append([])
                if want_lp:
                    logprobs.append(None)
                continue
            k = len(sr.spec_token_ids)
            if len(sampled) in verified:
                got, a = verified[len(sampled)]
            elif UNSAMPLEABLE in toks[i:i + k + 1]:
                errors[sr.request_id] = ("cannot sample the next token: the model's logits for "
                                         "it have no finite value (a NaN, or every token "
                                         "masked)")
                sampled.append([])
                if want_lp:
                    logprobs.append(None)
                i += k + 1
                continue
            else:
                got = toks[i:i + k + 1]
                a = 0
                while a < k and got[a] == sr.spec_token_ids[a]:
                    a += 1
            sampled.append(got[:a + 1])
            if want_lp:
                logprobs.append(None if sr.sampling_params.logprobs is None else
                                self._logprobs(sr.sampling_params, slogits[i:i + a + 1], got[:a + 1],
                                              sr.sampling_params.logprobs))
            i += k + 1
        return sampled, logprobs, prompt_logprobs, errors

    def _rejection_sample(self, out: SchedulerOutput, slogits: torch.Tensor,
                          draft_probs: list, starts: list[int]) -> dict[int, tuple]:
        """Verify the probabilistic drafts (those with draft probabilities), the requests with
        the same number of drafts together: {scheduled index: (kept tokens, accepted)}."""
        groups: dict[int, list[int]] = {}
        for x, (sr, q) in enumerate(zip(out.scheduled, draft_probs)):
            if q is not None and sr.samples:
                groups.setdefault(len(sr.spec_token_ids), []).append(x)
        verified = {}
        for k, idxs in groups.items():
            srs = [out.scheduled[x] for x in idxs]
            rows = torch.cat([torch.arange(starts[x], starts[x] + k + 1) for x in idxs])
            p = self.sampler.probs(slogits[rows], [sr.sampling_params for sr in srs
                                                   for _ in range(k + 1)])
            ids = [sr.request_id for sr in srs for _ in range(k + 1)]
            sps = [sr.sampling_params for sr in srs for _ in range(k + 1)]
            at = [t for sr in srs for t in range(sr.end_pos - k, sr.end_pos + 1)]
            u_end = self.sampler.uniforms(ids, sps, at, STREAM_SAMPLE).view(len(idxs), k + 1)
            u_acc = self.sampler.uniforms(ids, sps, at, STREAM_ACCEPT).view(len(idxs), k + 1)
            kept, acc = rejection_sample(
                p.view(len(idxs), k + 1, -1), torch.stack([draft_probs[x] for x in idxs]),
                torch.tensor([sr.spec_token_ids for sr in srs], dtype=torch.long),
                u_acc[:, :k], u_end)
            verified.update(zip(idxs, zip(kept, acc)))
        return verified

    def _logprobs(self, sp, rows: torch.Tensor, token_ids: list[int], k: int):
        """Logprobs of ``token_ids`` (one per row) and the top ``k``, per --logprobs-mode."""
        if getattr(self.sampler, "batch_invariant", False) and rows.shape[0]:
            # one row at a time on one thread: a row's values must not depend on how many rows
            # (a prompt's chunk) share the call (sloserve.model.invariant)
            with one_thread():
                values = torch.cat([lp.logprob_values(self._processed(sp, r[None]),
                                                      self.logprobs_mode) for r in rows])
                return lp.gather(values, token_ids, k)
        return lp.gather(lp.logprob_values(self._processed(sp, rows), self.logprobs_mode),
                         token_ids, k)

    def _processed(self, sp, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as --logprobs-mode reads them: processed_* modes take the sampler's
        processed logits (temperature, top-k, top-p)."""
        if self.logprobs_mode.startswith("processed"):
            return self.sampler.processed(rows, [sp] * rows.shape[0])
        return rows

    # ------------------------------------------------------------------ KV export / import
    def export_kv(self, block_ids: list[int], layer: int | None = None) -> torch.Tensor:
        """The KV of ``block_ids`` as a new contiguous tensor in the backend's block layout:
        all layers stacked ([num_layers, *one layer's export]) or one ``layer``. Its size is
        ``len(block_ids) * block_size * kv_bytes_per_token`` bytes for all layers."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        if layer is not None:
            return self.attn_backend.export_blocks(self.kv_caches[layer], ids)
        return torch.stack([self.attn_backend.export_blocks(c, ids) for c in self.kv_caches])

    def import_kv(self, block_ids: list[int], data: torch.Tensor, layer: int | None = None) -> None:
        """Write a buffer from :meth:`export_kv` (same layer selection, same number of blocks)
        into ``block_ids``.

        Raises:
            ValueError: the buffer's shape does not fit ``block_ids``.
        """
        ids = torch.tensor(block_ids, dtype=torch.long)
        layers = range(len(self.kv_caches)) if layer is None else [layer]
        parts = data if layer is None else data.unsqueeze(0)
        if parts.shape[0] != len(layers):
            raise ValueError(f"KV buffer holds {parts.shape[0]} layers, expected {len(layers)}")
        expect = list(self.attn_backend.export_blocks(self.kv_caches[0], ids[:0]).shape)
        expect[expect.index(0)] = len(block_ids)  # the layout's block dimension
        for li, part in zip(layers, parts):
            if list(part.shape) != expect:
                raise ValueError(f"KV buffer of shape {tuple(part.shape)} does not fit "
                                 f"{len(block_ids)} blocks, expected {tuple(expect)}")
            self.attn_backend.import_blocks(self.kv_caches[li], ids, part)
