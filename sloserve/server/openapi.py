"""The OpenAPI document states the limits the server really enforces.

pydantic describes only the field types; the ranges are checked in code (``SamplingParams``,
``Processor``), with messages that name the limit. Here the same ranges, some known only once
the model is loaded (the served name, max_model_len, the vocabulary, ``--max-logprobs``), are
written into ``/openapi.json``, so a client generated from it, or a fuzzer such as schemathesis,
sends what the engine can run. A request outside them still gets its 400.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from sloserve.sampling_params import MAX_STOP_STRINGS, MAX_TOP_K
from sloserve.server.protocol import MAX_N, OFF_VALUES

_INT64 = 2 ** 63


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The schema and its ``anyOf`` alternatives (pydantic writes ``X | None`` as anyOf)."""
    return [prop, *prop.get("anyOf", [])]


def _constrain(prop: dict[str, Any], **by_type: dict[str, Any]) -> None:
    """Add constraints to the branches of a given JSON type (integer=..., number=..., ...)."""
    for b in _branches(prop):
        extra = by_type.get(b.get("type"))
        if extra:
            b.update(extra)
        if b.get("type") == "array" and "items" in b and "items" in by_type:
            _constrain(b["items"], **by_type["items"])


def kv_transfer_object(info) -> dict[str, Any]:
    """The object branch of ``kv_transfer_params``: its keys, their types and the flag this
    server's KV role serves; unsatisfiable (only null is valid) without a KV connector."""
    role = info.kv_role
    if role is None:
        return {"not": {}}
    opt = ({"type": "string", "minLength": 1}, {"type": "null"})
    props: dict[str, Any] = {
        "do_remote_decode": {"type": "boolean"},
        "do_remote_prefill": {"type": "boolean"},
        **{k: {"anyOf": list(opt)} for k in ("transfer_id", "remote_engine_id", "remote_host")},
        "remote_port": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                                  {"type": "null"}]},
        "remote_block_ids": {"type": "array",
                             "items": {"type": "integer", "minimum": 0, "maximum": _INT64 - 1}},
    }
    if role == "kv_consumer":
        props["do_remote_decode"] = {"const": False}
    elif role == "kv_producer":
        props["do_remote_prefill"] = {"const": False}
    return {"properties": props, "additionalProperties": False}


def constraints(engine) -> dict[str, dict[str, dict[str, Any]]]:
    """{schema name: {property: constraints by JSON type}} for ``engine``'s limits."""
    info = engine.info
    vocab, max_len, k = info.vocab_size, info.max_model_len, info.max_logprobs
    token = {"integer": {"minimum": 0, "maximum": vocab - 1}}
    sampling = {
        "model": {"string": {"enum": [info.model_name]}},
        "temperature": {"number": {"minimum": 0}},
        "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}},
        "top_k": {"integer": {"minimum": -1, "maximum": MAX_TOP_K}},
        "seed": {"integer": {"minimum": -_INT64, "maximum": 2 * _INT64 - 1}},
        "n": {"integer": {"minimum": 1, "maximum": MAX_N}},
        "stop": {"array": {"maxItems": MAX_STOP_STRINGS}},
        "stop_token_ids": {"array": {}, "items": token},
        "priority": {"integer": ({"minimum": -_INT64, "maximum": _INT64 - 1}
                                 if info.scheduling_policy == "priority"
                                 else {"minimum": 0, "maximum": 0})},
        "cache_salt": {"string": {"minLength": 1}},
        **{name: ({"object": {"maxProperties": 0}} if isinstance(off, dict) else
                  {"number": {"minimum": off, "maximum": off},
                   "integer": {"minimum": off, "maximum": off}})
           for name, off in OFF_VALUES.items()},
        "max_tokens": {"integer": {"minimum": 1, "maximum": max_len - 1}},
        "kv_transfer_params": {"object": kv_transfer_object(info)},
    }
    # Anthropic's and the Responses API's bodies: their messages, tools and formats as this
    # server takes them (``messages_api``, ``responses_api``)
    text_message = {"object": {"properties": {"role": {"enum": ["user", "assistant"]},
                                              "content": {"type": "string"}},
                               "required": ["role", "content"]}}
    user_first = {"array": {"minItems": 1, "maxItems": 1}, "items": {
        "object": {**text_message["object"], "properties": {
            "role": {"const": "user"}, "content": {"type": "string", "minLength": 1}}}}}
    schema_object = {"type": "object", "properties": {"type": {"const": "object"}},
                     "required": ["type"]}
    name = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    anthropic_tools = {"array": {"maxItems": 4}, "items": {"object": {
        "properties": {"name": name, "input_schema": schema_object},
        "required": ["name", "input_schema"]}}}
    messages_fields = {
        "model": sampling["model"],
        "messages": user_first,
        "system": {"string": {}, "array": {}, "items": {"object": {
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "required": ["type", "text"]}}},
        "tools": anthropic_tools,
        "tool_choice": {"object": {"properties": {"type": {"enum": ["auto", "any", "none"]}},
                                   "required": ["type"]}},
    }
    return {
        "MessagesRequest": {
            **messages_fields,
            "max_tokens": {"integer": {"minimum": 1, "maximum": max_len - 1}},
            "temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "top_k": sampling["top_k"], "stop_sequences": sampling["stop"],
        },
        "CountTokensRequest": messages_fields,
        "ResponsesRequest": {
            "model": sampling["model"],
            "input": {"string": {"minLength": 1}, **user_first},
            "max_output_tokens": {"integer": {"minimum": 1, "maximum": max_len - 1}},
            "temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "tools": {"array": {"maxItems": 4}, "items": {"object": {
                "properties": {"type": {"const": "function"}, "name": name,
                               "parameters": schema_object},
                "required": ["type", "name"]}}},
            "tool_choice": {"string": {"enum": ["auto", "none", "required"]},
                            "object": {"not": {}}},
            "text": {"object": {"properties": {"format": {
                "type": "object", "properties": {"type": {"enum": ["text", "json_object"]}},
                "required": ["type"]}}}},
        },
        "CompletionRequest": {
            **sampling,
            "prompt": {"string": {"minLength": 1}, "array": {"minItems": 1},
                       "items": {"string": {"minLength": 1}, "array": {"minItems": 1},
                                 **token}},
            "logprobs": {"integer": {"minimum": 0, "maximum": k}},
            "prompt_logprobs": {"integer": {"minimum": 0, "maximum": k}},
            "suffix": {"string": {"maxLength": 0}},
        },
        "ChatCompletionRequest": {
            **sampling,
            "messages": {"array": {"minItems": 1}},
            "max_completion_tokens": {"integer": {"minimum": 1, "maximum": max_len - 1}},
            "top_logprobs": {"integer": {"minimum": 0, "maximum": k}},
        },
        "DetokenizeRequest": {"tokens": {"array": {}, "items": token},
                              "model": sampling["model"]},
        "TokenizeRequest": {"model": sampling["model"]},
    }


def install_openapi_constraints(app: FastAPI, engine) -> None:
    """Make ``app.openapi()`` (``/openapi.json``) carry :func:`constraints`."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = default()
        schemas = doc.get("components", {}).get("schemas", {})
        tok = schemas.get("TokenizeRequest")
        if tok is not None:  # exactly one of prompt and messages
            tok["oneOf"] = [{"required": ["prompt"], "not": {"required": ["messages"]}},
                            {"required": ["messages"], "not": {"required": ["prompt"]}}]
        for name, props in constraints(engine).items():
            for field, by_type in props.items():
                prop = schemas.get(name, {}).get("properties", {}).get(field)
                if prop is not None:
                    _constrain(prop, **by_type)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
