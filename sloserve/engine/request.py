"""A request's state as the scheduler sees it (no torch, no clock)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sloserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING ...) -> one FINISHED_* state; a
    decode instance's remote-prefill request goes WAITING -> WAITING_FOR_REMOTE_KVS -> WAITING
    (its KV and first token arrived: its next step is a decode) -> RUNNING."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holds its blocks while its KV arrives
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"       # EOS, stop token id or stop string
    FINISHED_LENGTH = "length"      # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"      # client went away / abort()

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason: "stop", "length", "abort", or None while unfinished."""
        return self.value if self.finished else None


@dataclass
class Request:
    """One generation request.

    Token accounting follows vLLM v1: `num_tokens` = prompt + output tokens;
    `num_computed_tokens` = tokens whose KV is in the cache. A request needs
    `num_tokens - num_computed_tokens` tokens scheduled: the rest of its prompt while prefilling,
    1 while decoding. After preemption `num_computed_tokens` drops to 0 and the prompt plus the
    tokens generated so far are recomputed.

    `spec_token_ids` are draft tokens proposed for the request's next positions: the scheduler
    puts them after its last token in the next decode step, where the runner verifies them
    (speculative decoding); rejected ones are rolled back.

    Times are seconds on whatever clock the caller passes in (the engine uses time.monotonic()).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    parent_request_id: str | None = None
    priority: int = 0               # lower runs first under the priority policy
    cache_salt: str | None = None   # requests with different salts share no cached blocks
    num_cached_tokens: int = 0      # prompt tokens its first admission found in the prefix cache
    deferred: bool = False          # moved back by SLO-aware deferral at least once
    block_hashes: list = field(default_factory=list)  # chained hashes of its full blocks so far
    num_prompt_logprobs_done: int = 0  # prompt positions whose logprobs were handed out
    #: structured output: the grammar state (``fill_bitmask(): bytes``, ``accept(token)``),
    #: or an object with ``ready`` False while it compiles (not admitted until then)
    grammar: object | None = None
    #: prefill/decode disaggregation (``engine.messages.KVTransferParams``), None: served
    #: here alone; cleared on a decode instance once the request's KV has arrived
    kv_transfer_params: object | None = None
    #: a prefill instance's finished request: the parameters its response carries
    kv_transfer_out: object | None = None
    # timestamps filled by the engine (seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the KV cache: the rest of the prompt while prefilling, 1 in decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token still has to go through the model."""
        return self.num_tokens_to_compute > 1 or self.num_output_tokens == 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
