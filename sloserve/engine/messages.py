"""The typed messages between the API process (front end) and the engine core.

Front end -> core: :class:`EngineCoreRequest` (a tokenized, validated request) and
:class:`EngineCoreAbort`. Core -> front end: one :class:`EngineCoreOutputs` per engine step
(per request: new token ids, finish reason, counters; per step: :class:`StepStats`; always: a
:class:`SchedulerStats` snapshot, which is all ``/metrics`` reads of the core), and a
:class:`EngineCoreReady` once, when the model is loaded (or failed to load).

All are ``msgspec.Struct``s, encoded as msgpack (:data:`encoder`, :func:`decode_to_core`,
:func:`decode_from_core`); in one process (offline ``LLM``, benchmarks) the same objects pass by
reference. Plain Python: no torch, no clock (times are the sender's ``time.monotonic()``, which on
Linux is one clock for every process of the machine).

Per-token and prompt logprobs travel as :class:`~sloserve.logprobs.Logprobs`; the ``n`` sibling
requests of one API request share a ``parent_request_id``.
"""
from __future__ import annotations

import msgspec

from sloserve.logprobs import Logprobs
from sloserve.sampling_params import SamplingParams



class KVTransferParams(msgspec.Struct, omit_defaults=True):
    """A request's part in prefill/decode disaggregation (vLLM's ``kv_transfer_params``, typed;
    the API's JSON object has these keys).

    With a KV connector (``--kv-transfer-config``; docs/disaggregation.md): a prefill instance's
    request has ``do_remote_decode``, a decode instance's ``do_remote_prefill``; both name the
    same ``transfer_id`` (the serial flow: the prefill instance's finished response carries the
    parameters the decode instance's request takes). Without one (the simulator), the KV moves
    outside the core and ``num_computed_tokens`` / ``output_token_ids`` say where the request
    stands.

    Attributes:
        do_remote_decode: on a prefill instance: checked with its whole ``max_tokens`` (the
            decode instance will need that much), then run to its first token only; its KV
            (and that token) go to the decode instance.
        do_remote_prefill: on a decode instance: the prompt's KV and the first token come
            from the prefill instance; the request's first step here is that token's decode.
        transfer_id: names the transfer on both instances (default on a prefill instance: its
            request id, returned in its response).
        remote_engine_id: the other instance's ``engine_id`` (informational).
        remote_host, remote_port: the other instance's KV connector: on a decode instance in
            pull mode, the prefill side to fetch from; on a prefill instance in push mode, the
            decode side to send to.
        remote_block_ids: the prefill instance's blocks holding the prompt (its response;
            informational: the decode side asks by ``transfer_id``).
        num_computed_tokens: without a connector, on a decode instance: tokens of the prompt
            and ``output_token_ids`` whose KV arrived from the prefill instance; the scheduler
            computes from there (fewer than the prompt plus the output tokens).
        output_token_ids: without a connector, on a decode instance: the tokens the prefill
            instance sampled.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] = []
    num_computed_tokens: int = 0
    output_token_ids: list[int] = []


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, tag=True):
    """A request the front end validated and tokenized.

    Attributes:
        request_id: unique among the core's unfinished requests.
        prompt_token_ids: the prompt (>= 1 token, every id in the vocabulary).
        sampling_params: sampling and stopping (max_tokens already resolved, never None).
        arrival_time: when the front end received it (s, monotonic): TTFT and queue time start here.
        eos_token_ids: the ids that end it (the model's and its tokenizer's; ignored with
            ``ignore_eos``).
        parent_request_id: the API request it belongs to when ``n`` > 1 (its siblings share it).
        priority: lower runs first under ``--scheduling-policy priority``.
        cache_salt: requests with different salts never share prefix-cache blocks.
        kv_transfer_params: prefill/decode disaggregation (None: a request served here alone).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: list[int] = []
    parent_request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None


class EngineCoreAbort(msgspec.Struct, tag=True):
    """Finish these requests now (client gone, stop string matched) and free their KV blocks;
    unknown or finished ids are ignored."""

    request_ids: list[str]


class EngineCoreResetPrefixCache(msgspec.Struct, tag=True):
    """Forget every cached prefix block (``POST /reset_prefix_cache``)."""


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """One request's progress in one step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (0 when only the finish is news, several
            after a verify step accepted draft tokens).
        finish_reason: None while running; ``stop`` (EOS or a stop token id), ``length``
            (max_tokens or max_model_len), ``abort`` (aborted, or failed: see ``error``).
        stop_reason: the stop token id that finished it (it is not part of the text).
        num_output_tokens: output tokens so far, the new ones included (core's count).
        num_cached_tokens: prompt tokens served from the prefix cache at its first admission.
        num_draft_tokens: draft tokens this step verified for it (speculative decoding).
        num_accepted_draft_tokens: of those, the ones the sampled tokens matched (counted
            before a stop condition cut the new tokens).
        num_preemptions: times the request was preempted so far.
        first_scheduled_time: when it was first scheduled (s, monotonic; set on finish).
        new_logprobs: for each of new_token_ids, when the request asked for ``logprobs``.
        new_prompt_logprobs: the prompt positions this step computed, when it asked for
            ``prompt_logprobs`` (position i gives prompt token i + 1; token 0 has none).
        parent_request_id: see :class:`EngineCoreRequest`.
        error: the core failed the request (an engine fault: HTTP 500, not a client error,
            unless ``bad_request``).
        bad_request: the failure is the request's own (a structured-output spec that no
            string satisfies): the API answers 400.
        kv_transfer_params: on a prefill instance's finished ``do_remote_decode`` request:
            what the decode instance's request takes (the API returns it).
        kv_transfer_s: on a decode instance's first output of a ``do_remote_prefill``
            request: seconds from its admission until its KV and first token had arrived.
    """

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    parent_request_id: str | None = None
    error: str | None = None
    bad_request: bool = False
    kv_transfer_params: KVTransferParams | None = None
    kv_transfer_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct):
    """The core's state after its latest step or input (what ``/metrics`` and overload control
    read; never the scheduler's live objects).

    Attributes:
        num_running, num_waiting: requests in the running list / the waiting queue.
        num_free_blocks, num_blocks: KV cache blocks free / in all.
        kv_cache_usage: 1 - free / all, in [0, 1].
        num_preemptions_total: preemptions since start.
        num_steps_total: engine steps since start.
        prefix_cache_queries_total, prefix_cache_hits_total: prompt tokens looked up in / served
            from the prefix cache since start (vLLM's counters: tokens, at admission).
        num_waiting_tokens: tokens the waiting requests still have to compute (their prompts):
            the queue ahead of a new arrival, for admission control.
        prefill_tokens_per_s: the core's measured prefill rate (0 until it has one).
        decode_step_s: its recent decode step time (s; 0 until it has one).
        prefill_step_s: its recent time of a step with prefill tokens (s; 0 until it has one).
        prefill_budget: prompt tokens the next step can take: the token budget less the
            running decodes (which take theirs first).
        num_requests_received_total: requests the core has queued since start (the front end's
            sent count minus this is what is still on its way).
        num_deferred_total: requests SLO-aware deferral moved back since start.
        num_grammar_compiles: structured-output grammars compiling or waiting to (0: no
            compile work left; a compile no request needs any more is stopped at once).
        num_waiting_for_kv: requests holding blocks while their KV arrives (a decode
            instance) or goes (a prefill instance's finished requests).
        kv_transfer_bytes_sent_total, kv_transfer_bytes_received_total: KV payload bytes the
            connector put on / took off its sockets since start.
        kv_transfer_failures_total: transfers that failed or timed out since start (either
            side).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_waiting_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    prefill_step_s: float = 0.0
    prefill_budget: int = 0
    num_requests_received_total: int = 0
    num_deferred_total: int = 0
    num_grammar_compiles: int = 0
    num_waiting_for_kv: int = 0
    kv_transfer_bytes_sent_total: int = 0
    kv_transfer_bytes_received_total: int = 0
    kv_transfer_failures_total: int = 0


class StepStats(msgspec.Struct):
    """One engine step, for ``/metrics`` and the demo's summary. Times in seconds.

    Attributes:
        start_time: when it was scheduled (monotonic).
        step_s: schedule + model + update; forward_s: the model forward alone.
        num_batched_tokens, num_prefill_tokens, num_decode_tokens: query tokens in the forward pass.
        num_generation_tokens: tokens sampled (accepted) this step.
        num_preemptions: requests preempted this step.
        kv_cache_usage: after scheduling, before finished requests freed blocks ([0, 1]).
        num_draft_tokens, num_accepted_draft_tokens: draft tokens verified / accepted this
            step (speculative decoding; in num_decode_tokens).
        num_sequences: requests in the step; num_attention_pairs, num_kv_tokens_read: its
            attention's query-key pairs and KV tokens read (``step_io.attention_work``).
    """

    start_time: float
    step_s: float
    forward_s: float
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    kv_cache_usage: float
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_sequences: int = 0
    num_attention_pairs: int = 0
    num_kv_tokens_read: int = 0


class EngineCoreOutputs(msgspec.Struct, tag=True):
    """What the core publishes after a step (``step`` set) or after inputs that changed its
    state without a step (aborts, adds: ``step`` None).

    Attributes:
        outputs: requests with news (tokens or a finish).
        scheduler_stats: the snapshot after it.
        step: the step's stats, None for a message sent without a step.
        timestamp: when it was sent (s, monotonic).
    """

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    step: StepStats | None = None
    timestamp: float = 0.0


class EngineInfo(msgspec.Struct):
    """What the front end needs to know of the loaded engine (sent once, in EngineCoreReady).

    Attributes:
        model_name: served name; model_path: where the weights came from (``/v1/models`` root).
        max_model_len: longest prompt + output (tokens).
        vocab_size: token ids must be below it.
        eos_token_ids: the model's end-of-sequence ids (the core stops on them).
        num_kv_blocks, block_size: the KV cache (a request needing more than their product of
            tokens can never run).
        max_num_batched_tokens: the step's token budget.
        dtype, kv_cache_dtype: what the engine computes in and caches KV in.
        dtype_reason: the one-line choice the core logged.
        pid: the core process (0 in-process).
        scheduling_policy: "fcfs" or "priority" (a request's priority only counts under the latter).
        max_logprobs: most logprobs a request may ask for (``--max-logprobs``).
        kv_role: the KV connector's role (``--kv-transfer-config``), None: no connector
            (requests with ``kv_transfer_params`` are refused, except the simulator's).
        kv_engine_id: the connector's ``engine_id`` (its ``kv_ip:kv_port`` by default).
        kv_host, kv_port: where its connector listens (the port it got where 0 was asked).
        kv_mode: ``pull`` or ``push`` (who connects to whom; docs/disaggregation.md).
        model_shape: the model's layer shapes and the bytes of weights a step reads (for the
            roofline of a step: ``sloserve.roofline.step.served_roofline``).
    """

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    dtype: str
    kv_cache_dtype: str
    dtype_reason: str = ""
    pid: int = 0
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    kv_role: str | None = None
    kv_engine_id: str | None = None
    kv_host: str | None = None
    kv_port: int | None = None
    kv_mode: str | None = None
    model_shape: dict = {}


class EngineCoreReady(msgspec.Struct, tag=True):
    """The core's first message: its EngineInfo, or why it could not start (a missing model,
    bad settings: ``error`` is one line for the user, ``error_type`` the exception's class)."""

    info: EngineInfo | None = None
    error: str | None = None
    error_type: str | None = None


ToCore = EngineCoreRequest | EngineCoreAbort | EngineCoreResetPrefixCache
FromCore = EngineCoreOutputs | EngineCoreReady

encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def decode_to_core(data: bytes) -> ToCore:
    """A front-end message. Raises msgspec.ValidationError / DecodeError on bad bytes."""
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    """A core message. Raises msgspec.ValidationError / DecodeError on bad bytes."""
    return _from_core.decode(data)
