"""Tool calling on /v1/chat/completions with the official ``openai`` client (a server with
--enable-auto-tool-choice --tool-call-parser hermes and the shipped hermes_chatml template):
forced calls (required, named) always parse and match their schema, streamed and
not; ``auto`` answers what the hermes parser reads out of the same greedy text; tool results
go back in the next turn; bad tool input is a 400 in OpenAI's error shape."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from sloserve.config import EngineConfig
from sloserve.server.tool_parsers import HermesToolParser
from sloserve.server.tools import ChatConfig

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather forecast of a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def live_server(helpers):
    """The session server's settings, with the tool flags and template."""
    with open(helpers.hermes_template) as f:
        chat = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          chat_template=f.read())
    srv = helpers.start_server(EngineConfig(model=None, dtype="float32", num_kv_blocks=512,
                                    max_model_len=2048, max_num_batched_tokens=512), chat=chat)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live_server, helpers) -> openai.OpenAI:
    return helpers.openai_client(live_server)


@pytest.fixture(scope="module")
def http(live_server, helpers):
    with helpers.http_client(live_server) as c:
        yield c


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_tool_choice_gives_calls_that_match_the_schema(client, live_server, choice):
    r = client.chat.completions.create(model=live_server.model, messages=ASK, tools=TOOLS,
                                       tool_choice=choice, max_tokens=120, temperature=0,
                                       parallel_tool_calls=False)
    m = r.choices[0]
    _check_calls(m.message.tool_calls, None if choice == "required" else ["get_weather"])
    assert len(m.message.tool_calls) == 1
    assert m.finish_reason == "tool_calls" and m.message.content is None


def test_parallel_calls_cut_short_keep_the_whole_ones(client, live_server):
    """Parallel calls allowed, the small model keeps adding calls until max_tokens: the calls
    that were completed are answered, the one cut short is not."""
    r = client.chat.completions.create(model=live_server.model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=120, temperature=0)
    m = r.choices[0]
    _check_calls(m.message.tool_calls)
    assert m.finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_forced_calls_reassemble_to_the_whole_answer(client, live_server, choice):
    kw = dict(model=live_server.model, messages=ASK, tools=TOOLS, tool_choice=choice,
              max_tokens=120, temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert c["id"] is None, "id sent twice"
                    c["id"], c["name"] = d.id, d.function.name
                c["arguments"] += d.function.arguments or ""
                pieces += 1
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(w.function.name, json.loads(w.function.arguments)) for w in whole]
    assert pieces > len(calls) + 1  # arguments in pieces, not one delta per call


def test_fifty_concurrent_forced_requests_give_fifty_valid_calls(live_server):
    async def one(client, i):
        r = await client.chat.completions.create(
            model=live_server.model, tools=TOOLS, max_tokens=120, temperature=0.8, seed=i,
            tool_choice="required" if i % 2 else NAMED, parallel_tool_calls=False,
            messages=[{"role": "user", "content": f"Weather and time in city number {i}?"}])
        return r.choices[0].message.tool_calls

    async def run():
        async with openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key="x",
                                      max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
    results = asyncio.run(run())
    assert len(results) == 50
    for calls in results:
        _check_calls(calls)


def test_auto_reads_the_calls_out_of_the_text_the_model_wrote(client, live_server):
    """Greedy: ``none`` gives the raw text (the same prompt: the tools are rendered either
    way); ``auto`` answers what the hermes parser reads out of it, streamed and not."""
    kw = dict(model=live_server.model, tools=TOOLS, max_tokens=60, temperature=0,
              messages=[{"role": "user", "content": "Call get_time for UTC, in a <tool_call>."}])
    raw = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert not raw.message.tool_calls
    want = HermesToolParser().extract(raw.message.content)
    got = client.chat.completions.create(tool_choice="auto", **kw).choices[0]
    assert got.message.content == want.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls or []] \
        == [(c.name, json.loads(c.arguments)) for c in want.tool_calls]
    assert got.finish_reason == ("tool_calls" if want.tool_calls else raw.finish_reason)
    content = "".join(ch.delta.content or "" for chunk in
                      client.chat.completions.create(stream=True, tool_choice="auto", **kw)
                      for ch in chunk.choices)
    assert content == (want.content or "")


def test_a_tool_result_turn_is_accepted(client, live_server):
    first = client.chat.completions.create(model=live_server.model, messages=ASK, tools=TOOLS,
                                           tool_choice=NAMED, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C all week."}]
    r = client.chat.completions.create(model=live_server.model, messages=msgs, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("body,param,phrase", [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "names function 'nope'"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools", ""),
    ({"tools": TOOLS, "messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages", "tool_call_id 'call_x' matches no tool call"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice", "tool_choice.function must be"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": WEATHER}}
                for i in range(300)], "tool_choice": "required"},
     "tools", "the forced tool call schema has"),
])
def test_bad_tool_input_is_a_400_and_the_server_keeps_serving(http, live_server, body, param,
                                                                phrase):
    r = http.post("/v1/chat/completions", json={"model": live_server.model, "messages": ASK,
                                                "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and phrase in err["message"]
    ok = http.post("/v1/chat/completions", json={"model": live_server.model, "messages": ASK,
                                                 "max_tokens": 2})
    assert ok.status_code == 200


#: a reply shaped as a reasoning model with tools answers (forced by a regex over the model's
#: own sampled tokens, so the streamed pieces split wherever its tokenizer splits them)
THINK_THEN_CALL = (r'<think>[a-z]{1,8}( [a-z]{1,8}){0,4}</think>Sure\.\n<tool_call>\n\{"name": '
                   r'"get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}", "days": [1-7]\}\}'
                   r'\n</tool_call>')


@pytest.fixture(scope="module")
def reasoning_server(helpers):
    with open(helpers.hermes_template) as f:
        chat = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          reasoning_parser="deepseek_r1", chat_template=f.read())
    srv = helpers.start_server(EngineConfig(model=None, dtype="float32", num_kv_blocks=256,
                                            max_model_len=2048, max_num_batched_tokens=512),
                               chat=chat)
    yield srv
    srv.stop()


def test_streamed_reasoning_then_a_call_arrives_whole_in_twenty_seeded_runs(reasoning_server,
                                                                            helpers):
    """The public failure case (a reasoning parser and a tool parser together lose streamed
    calls): 20 sampled runs through the server, each streamed: the reasoning arrives as
    ``reasoning_content``, the call whole (one id, its name once, arguments that parse and
    match the schema); for the first 5 seeds the stream says what the same seed's whole answer
    says."""
    client = helpers.openai_client(reasoning_server)
    for seed in range(20):
        kw = dict(model=reasoning_server.model, messages=ASK, tools=TOOLS, tool_choice="auto",
                  max_tokens=120, temperature=1.0, seed=seed,
                  extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}})
        reasoning, content, calls, finish = "", "", {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"ids": [], "names": [], "arguments": ""})
                    c["ids"] += [d.id] if d.id else []
                    c["names"] += [d.function.name] if d.function and d.function.name else []
                    c["arguments"] += (d.function.arguments or "") if d.function else ""
                finish = ch.finish_reason or finish
        assert finish == "tool_calls", seed
        assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){0,4}", reasoning), (seed, reasoning)
        assert content.strip() == "Sure.", (seed, content)
        assert list(calls) == [0] and calls[0]["names"] == ["get_weather"], (seed, calls)
        assert len(calls[0]["ids"]) == 1 and calls[0]["ids"][0].startswith("chatcmpl-tool-")
        args = json.loads(calls[0]["arguments"])
        jsonschema.validate(args, WEATHER)
        if seed < 5:
            whole = client.chat.completions.create(**kw).choices[0]
            assert (whole.finish_reason, whole.message.reasoning_content,
                    whole.message.content.strip()) == ("tool_calls", reasoning, "Sure."), seed
            assert [(c.function.name, json.loads(c.function.arguments))
                    for c in whole.message.tool_calls] == [("get_weather", args)], seed


def test_forced_json_is_never_read_as_reasoning(reasoning_server, helpers):
    """With --reasoning-parser, an output a grammar forces to be JSON (a required or named
    call, response_format json) has no reasoning section: it comes back as calls or content,
    on every API."""
    import anthropic
    import httpx
    srv = reasoning_server
    client = helpers.openai_client(srv)
    kw = dict(model=srv.model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
    for choice in ("required", NAMED):
        m = client.chat.completions.create(tool_choice=choice, **kw).choices[0]
        assert m.message.tool_calls and not getattr(m.message, "reasoning_content", None)
        _check_calls(m.message.tool_calls)
        args, reasoning = "", ""
        for chunk in client.chat.completions.create(tool_choice=choice, stream=True, **kw):
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                for d in ch.delta.tool_calls or []:
                    args += (d.function.arguments or "") if d.function else ""
        assert reasoning == "" and args.startswith("{")
    j = client.chat.completions.create(model=srv.model, messages=ASK, max_tokens=40,
                                       temperature=0, response_format={"type": "json_object"})
    assert j.choices[0].message.content and not getattr(j.choices[0].message,
                                                        "reasoning_content", None)
    ac = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
    msg = ac.messages.create(model=srv.model, max_tokens=120, messages=ASK,
                             tools=[{"name": "get_weather", "input_schema": WEATHER}],
                             tool_choice={"type": "any", "disable_parallel_tool_use": True},
                             extra_body={"temperature": 0})
    assert {b.type for b in msg.content} == {"tool_use"} and msg.stop_reason == "tool_use"
    r = httpx.post(srv.base_url + "/v1/responses", timeout=120, json={
        "model": srv.model, "input": "Weather in Paris for 3 days?", "temperature": 0,
        "max_output_tokens": 120, "tool_choice": "required", "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER}]}).json()
    assert [o["type"] for o in r["output"]][:1] == ["function_call"]


#: a schema as pydantic writes one: its parts in $defs, referenced from the root
SHIP = {"$defs": {"Address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
            "additionalProperties": False}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"},
                                         "back": {"anyOf": [{"$ref": "#/$defs/Address"},
                                                            {"type": "null"}]}},
        "required": ["to", "back"], "additionalProperties": False}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ship"}}])
def test_forced_calls_keep_a_schemas_local_references(client, live_server, choice):
    """A required choice wraps every tool's schema in one array schema: ``#/$defs/...`` of a
    tool must still resolve (to its own $defs), and the arguments match the tool's schema."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "ship", "parameters": SHIP}}]
    r = client.chat.completions.create(model=live_server.model, messages=[
        {"role": "user", "content": "Ship it to Paris."}], tools=tools, tool_choice=choice,
        max_tokens=120, temperature=0.8, seed=3, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments),
                            {**SCHEMAS, "ship": SHIP}[c.function.name])


def test_a_forced_call_cut_short_answers_alike_on_every_api(live_server, http):
    """``max_tokens`` ends a required call inside its JSON: no API returns its start as text;
    each says the output was cut (length / max_tokens / incomplete)."""
    model = live_server.model
    chat = http.post("/v1/chat/completions", json={
        "model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 6, "temperature": 0}).json()["choices"][0]
    assert chat["finish_reason"] == "length" and not chat["message"]["content"]
    assert not chat["message"]["tool_calls"]
    resp = http.post("/v1/responses", json={
        "model": model, "input": ASK[0]["content"], "tool_choice": "required",
        "max_output_tokens": 6, "temperature": 0, "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER}]}).json()
    assert resp["status"] == "incomplete" and resp["output"] == []
    msg = http.post("/v1/messages", json={
        "model": model, "messages": ASK, "max_tokens": 6, "temperature": 0,
        "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": WEATHER}]}).json()
    assert msg["stop_reason"] == "max_tokens" and msg["content"] == []
