"""What crosses the seam between the scheduler and the model runner, as plain data.

The scheduler decides a step (:class:`SchedulerOutput`); the model runner computes it and hands
back the sampled tokens (:class:`ModelRunnerOutput`). Neither holds a live object of the other
side (no ``Request``, no tensor), so both can be encoded (:func:`encode_scheduler_output`,
msgpack through msgspec), sent to another process and decoded: the seam a worker process, a KV
connector or the simulator can stand on. This module imports neither the scheduler nor torch.

Block ids: every scheduled request carries its **whole** block table (not only the blocks new
this step), so the runner keeps no per-request block state; a step after preemption or a KV
move needs no special case.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from sloserve.logprobs import Logprobs
from sloserve.sampling_params import SamplingParams

#: query tokens of the one-request steps whose cost over a decode the worker measures at
#: start-up where speculative decoding is on (``WorkerInfo.verify_cost``)
VERIFY_COST_TOKENS = (1, 2, 3, 5, 9, 16)

#: a draft token the worker fills in (speculative decoding with a model drafter: the core
#: proposes this many placeholders, the scheduler places them, the runner drafts them)
DRAFT_PLACEHOLDER = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step: it computes positions
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

    Attributes:
        request_id: the request.
        num_computed_tokens: tokens already in its KV cache (the first position computed now).
        num_new_tokens: query tokens this step (a prefill chunk, 1 for a decode, 1 + k for a
            decode that verifies k draft tokens).
        token_ids: the ``num_new_tokens`` token ids of those positions: the prompt chunk, or the
            last sampled token, then the draft tokens.
        block_ids: the request's whole block table after this step's allocation.
        sampling_params: how to sample its next token(s).
        samples: the chunk reaches the request's newest token, so 1 + len(spec_token_ids)
            tokens are sampled after it (the runner returns between 1 and that many).
        is_decode: one new token of a request that already has output (its KV is complete),
            possibly followed by draft tokens; prefill chunks and recomputation are not decodes.
        spec_token_ids: draft tokens proposed for verification (the last entries of token_ids);
            :data:`DRAFT_PLACEHOLDER` entries are drafted by the worker in the step.
        prompt_logprob_targets: for a request that asked for prompt logprobs, the prompt tokens
            that the chunk's first positions predict (position ``num_computed_tokens + i``
            predicts ``prompt_logprob_targets[i]``); empty otherwise.
        token_bitmask: structured output: per sampled position, the allowed tokens as a
            little-endian bitmask of ceil(vocab / 32) int32 words in bytes (bit ``t % 32`` of
            word ``t // 32`` set: token t allowed); empty: no constraint. One entry per sampled
            position leaves room for draft positions.
        num_prompt_tokens: the request's prompt length: positions below it are prompt
            positions, the others generated ones (--batch-invariant computes the two kinds on
            their own kernels, whatever chunk they come in); 0: not given (all generated).
    """

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams
    samples: bool
    is_decode: bool
    spec_token_ids: list[int] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    token_bitmask: list[bytes] = field(default_factory=list)
    num_prompt_tokens: int = 0

    @property
    def start_pos(self) -> int:
        """First position computed (= num_computed_tokens)."""
        return self.num_computed_tokens

    @property
    def end_pos(self) -> int:
        """Tokens in the request's KV cache after this step (its context length)."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class KVLoad:
    """A decode instance's request whose prompt KV (and first token) comes from a prefill
    instance (KV connector, ``sloserve.kv_transfer``).

    Attributes:
        transfer_id: names the transfer on both instances (the wire's key).
        request_id: the request here.
        block_ids: its blocks for positions [0, num_prompt_tokens).
        first_block: blocks below this index hold prefix-cache hits here and are not asked
            for (0: every block).
        num_prompt_tokens: the prompt's length.
        remote_host, remote_port: pull: the prefill instance's connector to connect to;
            None: push (the prefill instance connects here).
    """

    transfer_id: str
    request_id: str
    block_ids: list[int]
    first_block: int
    num_prompt_tokens: int
    remote_host: str | None = None
    remote_port: int | None = None


@dataclass
class KVSave:
    """A prefill instance's request whose prompt KV and first token go to a decode instance.

    Attributes:
        transfer_id, request_id, num_prompt_tokens: as in :class:`KVLoad`.
        remote_host, remote_port: push: the decode instance's connector to connect to; None:
            pull (the decode instance connects here and asks).
    """

    transfer_id: str
    request_id: str
    num_prompt_tokens: int
    remote_host: str | None = None
    remote_port: int | None = None


@dataclass
class KVConnectorMetadata:
    """What the connector's scheduler side tells its worker side with a step (vLLM's
    ``build_connector_meta``): transfers new since the previous step, and requests whose
    transfer must stop (aborted, timed out, not needed); each stopped one is reported back in
    :class:`KVConnectorOutput` before the scheduler frees its blocks."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.cancels)


@dataclass
class KVReceived:
    """A decode instance's request whose KV has all arrived, with what the prefill instance
    sampled after the prompt (its first output token) and the positions it computed."""

    request_id: str
    output_token_ids: list[int]
    num_computed_tokens: int
    seconds: float = 0.0


@dataclass
class KVConnectorOutput:
    """What the connector's worker side reports (vLLM's ``get_finished`` and load errors).

    Attributes:
        finished_sending: prefill-side requests whose KV is sent or whose transfer stopped
            (cancelled): their blocks may be freed.
        finished_recving: decode-side requests whose KV and first token arrived.
        failed: request id -> why, for transfers that failed or stopped on the decode side
            (their blocks may be freed; the request fails or recomputes) or failed on the
            prefill side (its blocks may be freed).
        bytes_sent_total, bytes_received_total, failures_total: the connector's counters
            since start.
    """

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[KVReceived] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_sent_total: int = 0
    bytes_received_total: int = 0
    failures_total: int = 0

    @property
    def has_news(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed)


def attention_work(decode_contexts, prefill_chunks, decode_drafts=()) -> tuple[int, int]:
    """(query-key pairs, KV tokens read) of a step's attention: a decode at context c (after the
    step) does c pairs and reads c tokens; one verifying d drafts does d * c - d (d + 1) / 2 pairs
    more (its d + 1 query rows see c - d .. c keys); a chunk of n tokens at start s does
    n * s + n (n + 1) / 2 pairs and reads s + n tokens."""
    pairs = (sum(decode_contexts) + sum(n * s + n * (n + 1) // 2 for n, s in prefill_chunks)
             + sum(d * c - d * (d + 1) // 2 for c, d in zip(decode_contexts, decode_drafts)))
    return pairs, sum(decode_contexts) + sum(s + n for n, s in prefill_chunks)


@dataclass
class SchedulerOutput:
    """What one engine step runs.

    Attributes:
        scheduled: decodes first, then prefill chunks, each in admission order.
        preempted_request_ids: requests preempted (blocks freed) while scheduling this step.
        finished_request_ids: requests that finished or were aborted since the previous step:
            the runner drops what it keeps per request (sampling generators).
        kv_connector_metadata: the KV connector's news for its worker side (None: no
            connector).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        """Query tokens of decodes (1 each, plus their draft tokens)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def attention_work(self) -> tuple[int, int]:
        """(query-key pairs, KV tokens read) of the step's attention (:func:`attention_work`)."""
        dec, pre = self.composition()
        return attention_work(dec, pre, [s.num_new_tokens - 1 for s in self.scheduled
                                         if s.is_decode])

    def composition(self) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """(context length of each decode after the step, (tokens, start position) of each
        prefill chunk): what a step cost model prices and what the step trace records."""
        dec, pre = [], []
        for s in self.scheduled:
            if s.is_decode:
                dec.append(s.end_pos)
            else:
                pre.append((s.num_new_tokens, s.num_computed_tokens))
        return tuple(dec), tuple(pre)


@dataclass
class ModelRunnerOutput:
    """What the runner computed for one :class:`SchedulerOutput`.

    Attributes:
        req_ids: every scheduled request, in the scheduler output's order.
        sampled_token_ids: per request, the tokens sampled after its chunk: none for a prefill
            chunk that does not finish the prompt, one for a decode or a finished prompt, and
            for a verify step the accepted draft tokens plus one more (between 1 and 1 + k).
        logprobs: per request, the logprobs of its sampled tokens (same length) when its
            sampling params ask for ``logprobs``, else None; empty list: none in the step.
        prompt_logprobs: per request, the logprobs of its ``prompt_logprob_targets``, or None;
            empty list: none in the step.
        prepare_s, forward_s, sample_s: seconds the runner spent building the inputs, in the
            model forward and sampling (perf_counter).
        draft_token_ids: per request, the draft tokens the worker proposed in place of
            :data:`DRAFT_PLACEHOLDER` entries (empty list: none in the step).
        draft_s: seconds the worker's drafter took (included in forward_s).
        kv_connector_output: the KV connector's worker side's news after the step (None: no
            connector).
        errors: requests whose logits could not be sampled (a NaN, or every token masked),
            with why: the scheduler fails them alone (their ``sampled_token_ids`` are empty).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    logprobs: list[Logprobs | None] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    draft_s: float = 0.0
    kv_connector_output: KVConnectorOutput | None = None
    errors: dict[str, str] = field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()
_sched_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_runner_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode_scheduler_output(out: SchedulerOutput) -> bytes:
    """msgpack bytes of a scheduler output (for another process)."""
    return _encoder.encode(out)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    """Inverse of :func:`encode_scheduler_output`. Raises msgspec.ValidationError on bad data."""
    return _sched_decoder.decode(data)


def encode_runner_output(out: ModelRunnerOutput) -> bytes:
    return _encoder.encode(out)


def decode_runner_output(data: bytes) -> ModelRunnerOutput:
    return _runner_decoder.decode(data)


@dataclass
class WorkerInfo:
    """What a worker tells the engine core about the model it loaded (once, at start-up).

    Attributes:
        model_name: the served name (``--served-model-name``, else the weights' name).
        model_path: where the weights came from.
        model_config: the model's ``sloserve.model.config.ModelConfig`` (plain data).
        dtype, kv_cache_dtype: what the worker computes in and caches KV in ("bfloat16", ...).
        dtype_reason: the worker's choice of dtypes and kernels, in words (its log lines).
        description: the attention backend and threads, for the core's start-up line.
        quantized_step_max_tokens: the most tokens a step may have and still run on the
            quantized weights (the memory-bound kernels; larger steps go to a dense GEMM at
            about twice a step's time or more); 0: no quantized weights.
        verify_cost: speculative decoding: what a step of one request with T query tokens
            costs over a one-token decode, for each T of :data:`VERIFY_COST_TOKENS` (measured
            at start-up; empty where speculative decoding is off).
        draft_pass_cost: a model drafter's pass (``draft_model``, ``layer_skip``) over a
            decode step, measured at start-up: each draft token of a step adds one (0: none).
        weight_bytes: bytes of weights a step reads (the quantized weights as the kernels
            hold them, else the dense ones); 0: unknown.
    """

    model_name: str
    model_path: str
    model_config: object
    dtype: str
    kv_cache_dtype: str
    dtype_reason: str = ""
    description: str = ""
    quantized_step_max_tokens: int = 0
    verify_cost: list[float] = field(default_factory=list)
    draft_pass_cost: float = 0.0
    weight_bytes: int = 0
