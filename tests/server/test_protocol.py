"""Request models: chat content parts, the sampling fields accepted only when off, tool_choice."""
from __future__ import annotations

import pytest

from sloserve.sampling_params import ParamError
from sloserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


def test_text_parts_joined_with_newlines():
    m = ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}])
    assert m.to_template_dict() == {"role": "user", "content": "a\nb"}


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "x"}},
     "only text content parts are supported, got 'image_url'"),
    ({"text": "no type"}, "only text content parts are supported, got None"),
    ({"type": "text"}, "a text content part needs a string 'text' field, got None"),
    ({"type": "text", "text": 5}, "a text content part needs a string 'text' field, got 5"),
])
def test_bad_part_names_the_problem(part, message):
    with pytest.raises(ParamError) as e:
        ChatMessage(role="user", content=[part]).to_template_dict()
    assert str(e.value) == message and e.value.param == "messages"


@pytest.mark.parametrize("field, off, on, message", [
    ("presence_penalty", 0, 0.5, "(only its off value 0), got 0.5"),
    ("frequency_penalty", 0.0, -1.0, "(only its off value 0), got -1.0"),
    ("logit_bias", {}, {"5": 1.0}, "(only its off value {}), got {'5': 1.0}"),
    ("repetition_penalty", 1.0, 0.5, "(only its off value 1), got 0.5"),
    ("min_p", 0, 2.0, "(only its off value 0), got 2.0"),
    ("min_tokens", 0, 10, "(only its off value 0), got 10"),
])
def test_unimplemented_sampling_fields_pass_only_when_off(field, off, on, message):
    CompletionRequest(prompt="x", **{field: off}).unsupported()   # None and off: accepted
    CompletionRequest(prompt="x", **{field: None}).unsupported()
    with pytest.raises(ParamError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                              **{field: on}).unsupported()
    assert e.value.param == field
    assert str(e.value) == f"{field} is not supported {message}"


def test_tool_choice_plans():
    """Each tool_choice's plan; auto needs the server's flags; a bad choice is a ParamError
    naming tool_choice (the route's 400)."""
    import json

    from sloserve.server.tools import ChatConfig, plan_tools
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    on = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")

    def plan(cfg=on, **kw):
        return plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw),
                          cfg)
    assert plan().mode == "none" and plan(tool_choice="none").mode == "none"
    assert plan(tools=tools).mode == "auto" and plan(tools=tools).parser.name == "hermes"
    assert plan(tools=tools, tool_choice="none").tools[0]["function"]["name"] == "f"
    named = plan(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.mode == "named" and json.loads(named.structured.json)["properties"] == {
        "a": {"type": "integer"}}
    req = plan(tools=tools, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.structured.json)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"type": "string", "const": "f"}
    for cfg, kw in ((ChatConfig(), {"tools": tools}),  # auto (the default) without the flags
                    (on, {"tool_choice": "auto"}),  # a choice without tools
                    (on, {"tools": tools, "tool_choice": "sometimes"}),
                    (on, {"tools": tools, "tool_choice": {"type": "function"}}),
                    (on, {"tools": [{"type": "function", "function": {"name": "f"}}] * 2})):
        with pytest.raises(ParamError) as e:
            plan(cfg, **kw)
        assert e.value.param in ("tool_choice", "tools"), kw
