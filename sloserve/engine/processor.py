"""Front-end request processing: tokenize and validate a request into an EngineCoreRequest.

Everything a client can get wrong is checked here, in the API process, before the engine core
sees the request, so a bad request is a 400 that names the limit and the core only ever gets
requests it can run (what the core still refuses is an engine fault, a 500).
"""
from __future__ import annotations

import time
from dataclasses import replace

from sloserve.engine.messages import EngineCoreRequest, EngineInfo, KVTransferParams
from sloserve.sampling_params import ParamError, SamplingParams, require_unicode


def check_kv_transfer(kv: KVTransferParams, info: EngineInfo) -> None:
    """Whether an engine described by ``info`` serves a request with ``kv``: it needs a KV
    connector (``info.kv_role``), a prefill request (``do_remote_decode``) a ``kv_producer``
    or ``kv_both`` one, a decode request (``do_remote_prefill``) a ``kv_consumer`` or
    ``kv_both`` one and, in pull mode, the prefill instance's ``remote_host`` and
    ``remote_port`` to fetch from; and a request is not both.

    Raises:
        ParamError: param ``kv_transfer_params``.
    """
    role = info.kv_role
    if role is None:
        raise ParamError("kv_transfer_params needs a server started with --kv-transfer-config",
                         "kv_transfer_params")
    if kv.do_remote_decode and kv.do_remote_prefill:
        raise ParamError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot "
                         "both be true", "kv_transfer_params")
    if kv.do_remote_decode and role == "kv_consumer":
        raise ParamError("kv_transfer_params.do_remote_decode (a prefill request) needs a "
                         "kv_producer or kv_both server; this one is kv_consumer",
                         "kv_transfer_params")
    if kv.do_remote_prefill and role == "kv_producer":
        raise ParamError("kv_transfer_params.do_remote_prefill (a decode request) needs a "
                         "kv_consumer or kv_both server; this one is kv_producer",
                         "kv_transfer_params")
    if kv.do_remote_prefill and not kv.transfer_id:
        raise ParamError("kv_transfer_params.do_remote_prefill needs transfer_id (the "
                         "prefill instance's response gives it)", "kv_transfer_params")
    if kv.do_remote_prefill and info.kv_mode == "pull" and not (kv.remote_host
                                                                 and kv.remote_port):
        raise ParamError("kv_transfer_params.do_remote_prefill needs remote_host and "
                         "remote_port (the prefill instance's KV connector) in pull mode",
                         "kv_transfer_params")


class Processor:
    """Turns prompts into validated :class:`EngineCoreRequest` objects.

    Args:
        tokenizer: the model's tokenizer (None: only token-id prompts are accepted).
        info: the engine's limits (max_model_len, vocabulary, KV capacity, eos ids).
    """

    def __init__(self, tokenizer, info: EngineInfo):
        self.tokenizer = tokenizer
        self.info = info
        self.eos_token_ids = sorted(set(info.eos_token_ids) | set(
            tokenizer.eos_token_ids if tokenizer is not None else ()))
        self._counter = 0

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Prompt text -> token ids (token id lists pass through). Raises ParamError."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("this model has no tokenizer; pass token ids", "prompt")
            # checked first: the tokenizer's own error would name its internals
            require_unicode(prompt, "the prompt", "prompt")
            try:
                return self.tokenizer.encode(prompt)
            except (TypeError, ValueError) as e:
                raise ParamError(f"cannot tokenize the prompt: {e}", "prompt") from e
        return list(prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, arrival_time: float | None = None,
                     parent_request_id: str | None = None, priority: int = 0,
                     cache_salt: str | None = None,
                     kv_transfer_params: KVTransferParams | None = None) -> EngineCoreRequest:
        """Tokenize and validate (thread-safe; touches no engine state).

        max_tokens=None becomes "up to max_model_len".

        Raises:
            ParamError: empty prompt, token id out of the vocabulary, prompt + max_tokens over
                max_model_len or over the KV cache (the message names the numbers and the limit),
                ``kv_transfer_params`` this engine does not serve (:func:`check_kv_transfer`).
        """
        info = self.info
        if kv_transfer_params is not None:
            check_kv_transfer(kv_transfer_params, info)
        if priority and info.scheduling_policy != "priority":
            raise ParamError(f"priority {priority} needs --scheduling-policy priority (the server "
                             f"runs {info.scheduling_policy})", "priority")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > info.max_logprobs:
                raise ParamError(f"{name} must be at most {info.max_logprobs} (the server's "
                                 f"--max-logprobs), got {v}", name)
        ids = self.encode(prompt)
        n = len(ids)
        if n == 0:
            raise ParamError("prompt must contain at least 1 token, got 0", "prompt")
        vocab = info.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ParamError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ParamError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")

        def over(limit: int) -> str:  # the field to change: the prompt once it alone fills limit
            return "prompt" if n >= limit else "max_tokens"

        mt = params.max_tokens
        if mt is None:
            if n >= info.max_model_len:
                raise ParamError(
                    f"This model's maximum context length is {info.max_model_len} tokens. "
                    f"However, your prompt has {n} tokens, leaving no room for output.", "prompt")
            params = replace(params, max_tokens=info.max_model_len - n)
        elif n + mt > info.max_model_len:
            raise ParamError(
                f"This model's maximum context length is {info.max_model_len} tokens. However, "
                f"you requested {n + mt} tokens ({n} in the prompt, {mt} in the completion "
                f"(max_tokens)). Please reduce the prompt or max_tokens.",
                over(info.max_model_len))
        capacity = info.num_kv_blocks * info.block_size
        if n + params.max_tokens > capacity:  # it could never run: it would preempt itself
            raise ParamError(f"request needs up to {n + params.max_tokens} tokens of KV cache "
                             f"(prompt {n} + max_tokens {params.max_tokens}), over the cache "
                             f"capacity of {capacity} tokens",
                             over(capacity))
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        return EngineCoreRequest(
            request_id=request_id, prompt_token_ids=ids, sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=list(self.eos_token_ids), parent_request_id=parent_request_id,
            priority=priority, cache_salt=cache_salt, kv_transfer_params=kv_transfer_params)
