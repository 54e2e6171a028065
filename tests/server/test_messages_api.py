"""Anthropic's Messages API with the official ``anthropic`` client: text, a forced tool call
whole and streamed, a tool_result turn, stop sequences, count_tokens, and errors in Anthropic's
shape (the server keeps serving)."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather forecast of a city",
          "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
#: the anthropic SDK (2.x) has no temperature argument any more; the server takes it
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ac(live_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.base_url, api_key="x", max_retries=0,
                               timeout=120)


def test_a_text_answer(ac, live_server):
    m = ac.messages.create(model=live_server.model, max_tokens=12, messages=ASK,
                           system="Answer briefly.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 12
    n = ac.messages.count_tokens(model=live_server.model, messages=ASK, system="Answer briefly.")
    assert n.input_tokens == m.usage.input_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_call_whole_and_streamed(ac, live_server, choice):
    kw = dict(model=live_server.model, max_tokens=120, messages=ASK, tools=TOOLS,
              tool_choice=choice, extra_body=GREEDY)
    m = ac.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) >= 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    # counted with the default (auto) choice on this server without auto tool choice: the
    # tools render into the prompt either way
    assert ac.messages.count_tokens(model=live_server.model, messages=ASK,
                                    tools=TOOLS).input_tokens == m.usage.input_tokens
    kinds = []
    with ac.messages.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type if ev.type != "content_block_delta" else ev.delta.type)
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json_delta" in kinds and "content_block_stop" in kinds
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in uses]


def test_a_tool_result_turn(ac, live_server):
    m = ac.messages.create(model=live_server.model, max_tokens=120, messages=ASK, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    use = next(b for b in m.content if b.type == "tool_use")
    msgs = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 21 C all week."}]}]
    r = ac.messages.create(model=live_server.model, max_tokens=8, messages=msgs, tools=TOOLS,
                           tool_choice={"type": "none"}, extra_body=GREEDY)
    assert r.content[0].type == "text" and r.usage.input_tokens > m.usage.input_tokens


def test_stop_sequences_say_which_one_stopped(ac, live_server):
    kw = dict(model=live_server.model, max_tokens=40, messages=ASK, extra_body=GREEDY)
    text = ac.messages.create(**kw).content[0].text
    at, stop = next((i, ch) for i, ch in enumerate(text)
                    if i >= 3 and ch.isalpha() and text.index(ch) == i)
    m = ac.messages.create(stop_sequences=["zzz-never-zzz", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:at]
    with ac.messages.stream(stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("body,kind,phrase", [
    ({"messages": ASK}, "invalid_request_error", "max_tokens"),  # max_tokens is required
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
     "invalid_request_error", "must be user or assistant"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "invalid_request_error", "block type 'image'"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool",
                                                                          "name": "nope"}},
     "invalid_request_error", "names function 'nope'"),
    ({"max_tokens": 4, "messages": ASK + [{"role": "assistant", "content": "ok"}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                     "content": "1"}]}]},
     "invalid_request_error", "matches no tool call"),
    ({"max_tokens": 4, "messages": ASK, "model": "other"}, "not_found_error", "other"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                   "name": "web_search"}]},
     "invalid_request_error", "is not served here"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "f"}]},
     "invalid_request_error", "needs an input_schema"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 5}, "invalid_request_error",
     "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "invalid_request_error", "a text block needs a string text"),
    ({"max_tokens": 4, "messages": ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f"}]}]},
     "invalid_request_error", "an object input"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "strin"}}}}]},
     "invalid_request_error", "strin"),  # a schema the grammar compiler refuses
])
def test_errors_are_in_anthropics_shape(http, live_server, body, kind, phrase):
    r = http.post("/v1/messages", json={"model": live_server.model, **body})
    assert r.status_code in (400, 404), r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == kind and phrase in j["error"]["message"]
    ok = http.post("/v1/messages", json={"model": live_server.model, "max_tokens": 2,
                                         "messages": ASK})
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_the_sdk_raises_its_own_error_types(ac, live_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=live_server.model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "document"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="missing", max_tokens=4, messages=ASK)


def test_json_of_a_streamed_text_answer_is_the_whole_one(ac, live_server):
    kw = dict(model=live_server.model, max_tokens=16, messages=ASK, extra_body=GREEDY)
    whole = ac.messages.create(**kw)
    with ac.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert json.loads(final.model_dump_json())["usage"]["output_tokens"] == whole.usage.output_tokens


def test_agent_routes_share_the_engine_path(http, live_server, engine, helpers):
    """Messages and Responses run as chat requests do: a client gone mid-stream aborts its
    request (every KV block free again), and vLLM's priority / cache_salt pass through (one
    salt's prefix is not another's; a priority under fcfs is refused by the engine's rule)."""
    model = live_server.model
    for path, body in (("/v1/messages", {"max_tokens": 400, "messages": ASK}),
                       ("/v1/responses", {"max_output_tokens": 400, "input": "Count to 100."})):
        with http.stream("POST", path, json={"model": model, "stream": True, "ignore_eos": True,
                                             **body}) as r:
            assert r.status_code == 200
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("data: ") and "delta" in line
                if deltas >= 3:
                    break  # the client goes away
        helpers.wait_all_blocks_free(engine)
    long = [{"role": "user", "content": "Describe the sea and the sky and the hills. " * 8}]

    def cached(salt: str) -> int:
        r = http.post("/v1/messages", json={"model": model, "max_tokens": 1, "messages": long,
                                            "cache_salt": salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"]
    cached("salt-a")
    assert cached("salt-a") > 0 and cached("salt-b") == 0
    # priority reaches the engine, which refuses it under fcfs as vLLM does (in each shape)
    r = http.post("/v1/responses", json={"model": model, "input": "x", "priority": 1})
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
    r = http.post("/v1/messages", json={"model": model, "max_tokens": 1, "messages": ASK,
                                        "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
