"""OpenAI's Responses API with the official ``openai`` client: text, a function tool (forced)
whole and through ``client.responses.stream``, a follow-up turn through
``previous_response_id``, ``text.format`` json_schema, ``store`` and the 404 of an unknown id."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
          "parameters": WEATHER}]
NAMED = {"type": "function", "name": "get_weather"}


def test_a_text_response(client, live_server):
    r = client.responses.create(model=live_server.model, input="Say hello.",
                                instructions="Answer in one short sentence.",
                                max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp")
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert client.responses.retrieve(r.id).output[0].content[0].text == r.output_text


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_function_call_then_its_output_in_the_next_turn(client, live_server, choice):
    kw = dict(model=live_server.model, tools=TOOLS, tool_choice=choice, temperature=0,
              max_output_tokens=120, parallel_tool_calls=False)
    r = client.responses.create(input="Weather in Paris for 3 days?", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(
        model=live_server.model, previous_response_id=r.id, max_output_tokens=8,
        temperature=0, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C."}])
    assert follow.previous_response_id == r.id and follow.output_text
    assert follow.usage.input_tokens > r.usage.input_tokens  # the first turn came along


def test_the_stream_helper_reassembles_the_whole_response(client, live_server):
    kw = dict(model=live_server.model, input="Weather in Paris for 3 days?", tools=TOOLS,
              tool_choice=NAMED, temperature=0, max_output_tokens=120, parallel_tool_calls=False)
    whole = client.responses.create(**kw)
    kinds = []
    with client.responses.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    got = [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"]
    assert got == [(o.name, json.loads(o.arguments)) for o in whole.output
                   if o.type == "function_call"]


def test_streamed_text_equals_the_whole_text(client, live_server):
    """Cut at max_output_tokens: status incomplete, ``response.incomplete`` last (as OpenAI's
    API sends it), the same text as the whole response."""
    kw = dict(model=live_server.model, input="Name three colours.", temperature=0,
              max_output_tokens=6)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(**kw) as s:
        events = list(s)
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete"
    assert text == whole.output_text == events[-1].response.output_text


def test_text_format_json_schema(client, live_server):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    r = client.responses.create(model=live_server.model, input="A colour, as JSON.",
                                temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "c",
                                                 "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_unknown_or_unstored_previous_response_is_a_404(client, live_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=live_server.model, input="x", max_output_tokens=2,
                                previous_response_id="resp_nope")
    assert "resp_nope" in str(e.value)
    r = client.responses.create(model=live_server.model, input="x", max_output_tokens=2,
                                store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=live_server.model, input="y", max_output_tokens=2,
                                previous_response_id=r.id)


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "text": {"format": "x"}}, "text"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "metadata": {"k": "\ud800"}}, "metadata"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "tool_choice": "required", "tools": [{"type": "function", "name": "f",
      "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}]}, "tools"),
])
def test_bad_input_is_a_400(http, live_server, body, param):
    # (ASCII JSON: a lone surrogate travels as its escape, as a client's JSON encoder sends it)
    r = http.post("/v1/responses", headers={"content-type": "application/json"},
                  content=json.dumps({"model": live_server.model, "max_output_tokens": 2,
                                      **body}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
