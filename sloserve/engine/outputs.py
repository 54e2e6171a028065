"""What the engine hands back per request per step (no torch, no HTTP)."""
from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.engine.messages import KVTransferParams
from sloserve.logprobs import Logprobs


@dataclass
class RequestOutput:
    """A request's progress after one engine step (delta form, for streaming).

    Attributes:
        request_id: the id given to add_request.
        new_text: text that became visible this step (may be "" while UTF-8 or a possible stop
            string is held back).
        new_token_ids: tokens generated this step.
        text: all visible text so far.
        token_ids: all output token ids so far.
        finished: no more output will come.
        finish_reason: "stop", "length", "abort" or None.
        num_prompt_tokens, num_output_tokens: usage counts (tokens).
        num_cached_tokens: prompt tokens the prefix cache served (usage's
            ``prompt_tokens_details.cached_tokens``).
        error: set when the engine failed this request (the request is finished).
        bad_request: the failure is the request's own (HTTP 400, not 500).
        new_logprobs: logprobs of new_token_ids, when the request asked for ``logprobs``.
        prompt_logprobs: logprobs of prompt tokens 1.. (token 0 has none), when it asked for
            ``prompt_logprobs``: all of them, in its first output with tokens (or its last).
        prompt_token_ids: the prompt, in that same output (for ``echo``).
        kv_transfer_params: in the finished output of a prefill instance's
            ``do_remote_decode`` request: what its decode request takes (the API returns it).
    """

    request_id: str
    new_text: str
    new_token_ids: list[int]
    text: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    #: the stop string that finished it (vLLM's ``stop_reason``), else None
    stop_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    bad_request: bool = False
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: KVTransferParams | None = None
