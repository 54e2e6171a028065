"""OpenAI-compatible request and response bodies (pydantic v2).

Field names, defaults and extensions follow the OpenAI API and vLLM's OpenAI server:
``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``skip_special_tokens`` are vLLM extensions.
Unknown fields are ignored (like vLLM); known-but-unsupported ones are rejected by
:meth:`CompletionRequest.unsupported` / :meth:`ChatCompletionRequest.unsupported` so a client never
silently gets different semantics than it asked for.

``kv_transfer_params`` (vLLM's field for prefill/decode disaggregation) is a JSON object on the
wire, typed by :func:`kv_transfer_params_from_json`; a response carries the finished prefill
request's parameters top-level (:func:`kv_transfer_params_to_json`).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union

import msgspec
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr,
                      field_validator, model_serializer, model_validator)

from sloserve.engine.messages import KVTransferParams
from sloserve.sampling_params import (ParamError, SamplingParams, StructuredOutputsParams,
                                      require_unicode)

#: most choices (``n``) per request, and most choices over all prompts of a request
MAX_N = 128


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):  # pydantic's lax mode would read true as 1 and false as 0
        raise ValueError("must be an integer, not a boolean")
    return v


#: an integer request field: JSON true / false are refused (not read as 1 / 0)
Int = Annotated[int, BeforeValidator(_not_bool)]


def random_id(prefix: str) -> str:
    """``<prefix>-<uuid4 hex>``, e.g. ``cmpl-3f2a...`` (OpenAI-style response / request id)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """Current Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


# ----------------------------------------------------------------------- kv_transfer_params
#: keys of KVTransferParams an API client may not send: the simulator's, set by the engine
KV_TRANSFER_ENGINE_KEYS = ("num_computed_tokens", "output_token_ids")
#: keys an API client may send, and their types
KV_TRANSFER_KEYS = {f.name: f.type for f in msgspec.structs.fields(KVTransferParams)
                    if f.name not in KV_TRANSFER_ENGINE_KEYS}
_BLOCK_ID_LIMIT = 2 ** 63


def _kv_value(key: str, value: Any) -> Any:
    """One key of ``kv_transfer_params``, checked against its type (JSON true is not 1, no
    string is coerced) and its range. Raises ParamError naming the key."""
    where = f"kv_transfer_params.{key}"
    try:
        value = msgspec.convert(value, KV_TRANSFER_KEYS[key], strict=True)
    except msgspec.ValidationError as e:
        raise ParamError(f"{where}: {e}", "kv_transfer_params") from None
    if isinstance(value, str):
        if not value:
            raise ParamError(f"{where} must be a non-empty string", "kv_transfer_params")
        require_unicode(value, where, "kv_transfer_params")
    if key == "remote_port" and value is not None and not 1 <= value <= 65535:
        raise ParamError(f"{where} must be in [1, 65535], got {value}", "kv_transfer_params")
    if key == "remote_block_ids" and any(not 0 <= b < _BLOCK_ID_LIMIT for b in value):
        raise ParamError(f"{where} must be integers in [0, 2**63)", "kv_transfer_params")
    return value


def kv_transfer_params_from_json(obj: dict[str, Any]) -> KVTransferParams:
    """The request field ``kv_transfer_params`` (a JSON object) as :class:`KVTransferParams`.

    Raises:
        ParamError (param ``kv_transfer_params``, the message naming the key): a key that is
            not one of :data:`KV_TRANSFER_KEYS` (``num_computed_tokens`` and
            ``output_token_ids`` are the engine's, never a client's), a value of the wrong
            type or out of range, or both ``do_remote_decode`` and ``do_remote_prefill``.
    """
    for key in obj:
        if key in KV_TRANSFER_ENGINE_KEYS:
            raise ParamError(f"kv_transfer_params.{key} is set by the engine, not by API "
                             f"clients", "kv_transfer_params")
        if key not in KV_TRANSFER_KEYS:
            raise ParamError(f"kv_transfer_params: unknown key {key!r} (known: "
                             f"{', '.join(KV_TRANSFER_KEYS)})", "kv_transfer_params")
    kv = KVTransferParams(**{k: _kv_value(k, v) for k, v in obj.items()})
    host = kv.remote_host
    if host is not None and (len(host) > 253 or not all(c.isalnum() or c in ".-:_[]%"
                                                         for c in host)):
        raise ParamError(f"kv_transfer_params.remote_host must be a host name or an IP address "
                         f"(at most 253 characters of letters, digits and .-:_[]%), got "
                         f"{host[:40]!r}{'...' if len(host) > 40 else ''}", "kv_transfer_params")
    if kv.do_remote_decode and kv.do_remote_prefill:
        raise ParamError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot "
                         "both be true", "kv_transfer_params")
    return kv


def kv_transfer_params_to_json(kv: KVTransferParams | None) -> dict[str, Any] | None:
    """A response's top-level ``kv_transfer_params``: the fields of ``kv`` that differ from
    their defaults (None: the request has none to return)."""
    return None if kv is None else msgspec.to_builtins(kv)


# ---------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ----------------------------------------------------------------------------------------- common
class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    """Token counts of one request (tokens)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))

    @classmethod
    def from_output(cls, out) -> "UsageInfo":
        """The usage of a finished ``RequestOutput``."""
        return cls.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request field: exactly one of these."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


#: sampling fields accepted only at the value that turns them off (None is off too)
OFF_VALUES: dict[str, Any] = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
                               "repetition_penalty": 1, "min_p": 0, "min_tokens": 0}


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI names; vLLM extensions marked)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None        # None -> 1.0 (OpenAI / vLLM default)
    top_p: float | None = None              # None -> 1.0
    top_k: Int | None = None                # extension; None / 0 / -1: disabled
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None  # extension
    ignore_eos: bool = False                  # extension
    skip_special_tokens: bool = True          # extension
    n: Int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None                   # accepted, ignored
    priority: Int | None = 0                  # extension: lower runs first (null: 0)
    cache_salt: str | None = None             # extension: prefix-cache isolation key
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # extension (vLLM's)
    # accepted only at their "off" values
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None   # extension (vLLM's); off at 1
    min_p: float | None = None                # extension (vLLM's); off at 0
    min_tokens: Int | None = None             # extension (vLLM's); off at 0
    #: extension (vLLM's): prefill/decode disaggregation (:func:`kv_transfer_params_from_json`)
    kv_transfer_params: dict[str, Any] | None = None
    #: vLLM's old ``guided_*`` fields the request gave (not null); ignored, but refused with
    #: kv_transfer_params
    _guided: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_guided(cls, data: Any, handler):
        m = handler(data)
        if isinstance(data, dict):
            m._guided = tuple(k for k, v in data.items()
                              if isinstance(k, str) and k.startswith("guided_") and v is not None)
        return m

    def kv_transfer(self) -> KVTransferParams | None:
        """``kv_transfer_params`` typed (None: not given).

        Raises:
            ParamError: the object is invalid (:func:`kv_transfer_params_from_json`), or the
                request asks for what disaggregated serving does not serve yet
                (:meth:`_kv_transfer_unsupported`; the message names the field).
        """
        if self.kv_transfer_params is None:
            return None
        kv = kv_transfer_params_from_json(self.kv_transfer_params)
        self._kv_transfer_unsupported()
        return kv

    def _kv_transfer_unsupported(self) -> None:
        """Fields refused together with kv_transfer_params: ``n`` other than 1, structured
        outputs (``response_format`` other than text, ``structured_outputs``, ``guided_*``)."""
        if self.n not in (None, 1):
            raise ParamError(f"n must be 1 with kv_transfer_params, got {self.n}", "n")
        if self.response_format is not None and self.response_format.type != "text":
            _kv_refuse("response_format")
        if self.structured_outputs is not None:
            _kv_refuse("structured_outputs")
        for name in self._guided:
            _kv_refuse(name)

    def _common_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options can only be given with stream: true (vLLM's rule)",
                             "stream_options")
        if self.priority is None:
            self.priority = 0
        if isinstance(self.priority, bool) or not -2 ** 63 <= self.priority < 2 ** 63:
            raise ParamError(f"priority must be an integer in [-2**63, 2**63), got {self.priority}",
                             "priority")
        if self.cache_salt is not None and not self.cache_salt:
            raise ParamError("cache_salt must be a non-empty string", "cache_salt")
        if self.cache_salt is not None:
            require_unicode(self.cache_salt, "cache_salt", "cache_salt")
        if self.n is None:
            self.n = 1
        if isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ParamError(f"n must be an integer in [1, {MAX_N}], got {self.n}", "n")
        for name, off in OFF_VALUES.items():  # a client must not think these took effect
            value = getattr(self, name)
            if value is not None and value != off:
                raise ParamError(f"{name} is not supported (only its off value {off!r}), "
                                 f"got {value!r}", name)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ParamError (e.g. temperature < 0, top_p outside (0, 1], max_tokens < 1)."""
        return SamplingParams(
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=self.structured_spec(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The output constraint of ``structured_outputs`` or ``response_format`` (not both).

        Raises:
            ParamError: both given, a json_schema format without a schema, or not exactly one
                field of structured_outputs.
        """
        so, rf = self.structured_outputs, self.response_format
        if rf is not None and rf.type == "text":
            rf = None
        if so is not None and rf is not None:
            raise ParamError("give response_format or structured_outputs, not both",
                             "response_format")
        if rf is not None:
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ParamError("response_format json_schema needs json_schema.schema",
                                 "response_format")
            return StructuredOutputsParams(json=json.dumps(rf.json_schema.schema_))
        if so is None:
            return None
        j = so.json_
        return StructuredOutputsParams(
            json=j if isinstance(j, str) or j is None else json.dumps(j),
            json_object=bool(so.json_object), regex=so.regex, choice=so.choice,
            grammar=so.grammar)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every
        content chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _kv_refuse(name: str) -> None:
    raise ParamError(f"{name} is not supported with kv_transfer_params (disaggregated "
                     f"prefill/decode) yet", name)


class _KVTransferChunk(BaseModel):
    """A streamed chunk's top-level ``kv_transfer_params`` (its subclasses' field): on the
    last chunk of a request that has them to return, left out of the JSON otherwise."""

    @model_serializer(mode="wrap")
    def _drop_unset_kv_transfer(self, handler):
        d = handler(self)
        if d.get("kv_transfer_params") is None:
            d.pop("kv_transfer_params", None)
        return d


# ------------------------------------------------------------------------------------ completions
class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body.

    ``prompt``: a string, a list of token ids, or a list holding exactly one of those.
    ``max_tokens`` defaults to 16 (OpenAI); null means "up to max_model_len".
    """

    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Int | None = 16
    echo: bool | None = False
    logprobs: Int | None = None
    prompt_logprobs: Int | None = None  # extension (vLLM's)
    best_of: Int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_bool_token_ids(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(t, bool) or (
                isinstance(t, list) and any(isinstance(u, bool) for u in t)) for t in v):
            raise ValueError("token ids must be integers, not booleans")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (a string, token ids, or a list of either).

        Raises:
            ParamError: no prompt, or more than MAX_N choices over all prompts.
        """
        p = self.prompt
        if isinstance(p, str) or not p or not isinstance(p[0], (str, list)):
            out = [p]  # one string or one list of ids (empty: rejected as 0 tokens later)
        else:
            out = list(p)
        n = self.n if isinstance(self.n, int) and 1 <= self.n <= MAX_N else 1  # else: 400 later
        if len(out) * n > MAX_N:
            raise ParamError(f"at most {MAX_N} choices per request (prompts x n), got "
                             f"{len(out)} x {n}", "prompt")
        return out

    def unsupported(self) -> None:
        """Raise ParamError for fields this server does not implement."""
        self._common_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(f"best_of must equal n ({self.n}), got {self.best_of}", "best_of")
        if self.suffix:
            raise ParamError("suffix is not supported", "suffix")
        self.kv_transfer()

    def _kv_transfer_unsupported(self) -> None:
        """As for both endpoints, and one prompt, no ``logprobs``, ``prompt_logprobs`` or
        ``echo``."""
        super()._kv_transfer_unsupported()
        p = self.prompt
        if isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list)):
            raise ParamError(f"kv_transfer_params takes one prompt, got {len(p)}", "prompt")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _kv_refuse(name)
        if self.echo:
            _kv_refuse("echo")

    def to_sampling_params(self) -> SamplingParams:
        """Raises ParamError for out-of-range values. ``echo`` with ``logprobs`` asks for the
        prompt's logprobs too (as vLLM does)."""
        plp = self.prompt_logprobs
        if plp is None and self.echo and self.logprobs is not None:
            plp = self.logprobs
        return self._sampling_params(self.max_tokens, self.logprobs, plp)


class CompletionLogProbs(BaseModel):
    """Completions ``logprobs``: per token its text, its logprob (None for the first prompt
    token with ``echo``), the top tokens' logprobs and its character offset in the text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of a prompt position (vLLM's ``Logprob``): its value, its rank in the whole
    distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    #: ``prompt_logprobs`` (vLLM's extension): None for the first prompt token, then per
    #: prompt token its own entry and the top ones', keyed by token id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    #: vLLM's: a prefill request's parameters for its decode request (null otherwise)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(_KVTransferChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------------- chat
class ChatMessage(BaseModel):
    """One input message. ``content`` may be a string or OpenAI content parts (text only)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: an assistant turn's calls: ``[{"id", "type": "function", "function": {"name",
    #: "arguments": JSON text}}]``
    tool_calls: list[dict[str, Any]] | None = None
    #: a ``tool`` message: the call it answers
    tool_call_id: str | None = None

    def to_template_dict(self, content_format: str = "auto") -> dict[str, Any]:
        """The message as the chat template expects it (content parts joined into one string,
        or with ``content_format`` ``openai`` kept as a list of ``{"type": "text", "text"}``
        parts; a call's arguments as an object, as templates render them with ``tojson``).

        Raises:
            ParamError: a non-text content part, a call without a function name or whose
                arguments are not a JSON object.
        """
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ParamError(f"only text content parts are supported, got "
                                     f"{part.get('type')!r}", "messages")
                if not isinstance(part.get("text"), str):
                    raise ParamError("a text content part needs a string 'text' field, got "
                                     f"{part.get('text')!r}", "messages")
                texts.append(part["text"])
            content = ([{"type": "text", "text": t} for t in texts] if content_format == "openai"
                       else "\n".join(texts))
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def _template_call(call: Any) -> dict[str, Any]:
    """An assistant message's tool call as chat templates take it (arguments parsed)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ParamError("each tool call of a message needs function.name", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ParamError(f"the arguments of tool call {call.get('id')!r} are not JSON: "
                             f"{args[:80]!r}", "messages") from None
    if not isinstance(args, dict):
        raise ParamError(f"the arguments of tool call {call.get('id')!r} must be a JSON object",
                         "messages")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body.

    ``max_completion_tokens`` (preferred) or ``max_tokens``; None means "up to max_model_len".
    """

    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    #: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    #: (sloserve.server.tools.plan_tools reads it)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # extension
    #: a required or named tool_choice's constraint (set by the route, never by the client)
    _forced_structured: StructuredOutputsParams | None = PrivateAttr(default=None)

    def structured_spec(self) -> StructuredOutputsParams | None:
        """A forced tool choice's constraint, else as for both endpoints."""
        if self._forced_structured is not None:
            return self._forced_structured
        return super().structured_spec()

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def unsupported(self) -> None:
        """Raise ParamError for fields this server does not implement."""
        self._common_unsupported()
        if not self.messages:
            raise ParamError("messages must contain at least one message", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
        self.kv_transfer()

    def _kv_transfer_unsupported(self) -> None:
        """As for both endpoints, and no ``logprobs``."""
        super()._kv_transfer_unsupported()
        if self.logprobs:
            _kv_refuse("logprobs")

    def to_sampling_params(self) -> SamplingParams:
        """Raises ParamError for out-of-range values."""
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(mt, lp)
        except ParamError as e:
            if e.param == "max_tokens":
                e.param = self.max_tokens_param
            raise


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallModel(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallModel] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCallModel(BaseModel):
    """A streamed piece of a call: index, then id, type and name once, arguments in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    """One output token: its own logprob, then exactly ``top_logprobs`` alternatives sorted
    most likely first."""

    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    #: vLLM's: a prefill request's parameters for its decode request (null otherwise)
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    """A streamed chat delta; unset (None) fields are left out of the JSON."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCallModel] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_KVTransferChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


# ----------------------------------------------------------------------------------------- models
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "sloserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------- kv_transfer
class KVTransferInfo(BaseModel):
    """``GET /kv_transfer``: the KV connector of this server (``--kv-transfer-config``), for a
    router that pairs prefill and decode instances."""

    kv_role: str                  # kv_producer, kv_consumer or kv_both
    engine_id: str | None = None
    kv_host: str | None = None    # where the connector listens
    kv_port: int | None = None
    mode: str | None = None       # pull or push
