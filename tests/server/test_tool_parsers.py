"""Tool-call parsers on recorded texts: whole outputs, and the same texts streamed with every
split point (inside the tags, the names, the JSON, its strings and escapes): the streamed
content and the calls the ``openai`` client would reassemble equal the whole output's."""
from __future__ import annotations

import itertools
import json

import pytest

from sloserve.server.tool_parsers import ToolCallDelta, get_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NESTED = ('{"name": "search", "arguments": {"q": "a \\"quoted\\" } brace", '
          '"filters": {"tags": ["x", "y}"], "n": 3}}}')

# (parser, text, content, [(name, arguments object)])
CASES = [
    ("hermes", "Just text, no call.", "Just text, no call.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{NESTED}</tool_call>",
     "Let me look.\n\n", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                          ("search", {"q": 'a "quoted" } brace',
                                      "filters": {"tags": ["x", "y}"], "n": 3}})]),
    # arguments given as a JSON string (some models write them so): sent whole at the end
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", {"a": 1})]),
    # not a call: left in the content as written
    ("hermes", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    # the model stopped before the end tag: the call is still whole
    ("hermes", f"<tool_call>{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", "1 < 2 and <tool_ not a tag", "1 < 2 and <tool_ not a tag", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, {"y": 2}]}}',
     None, [("a", {}), ("b", {"x": [1, {"y": 2}]})]),
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
]


def _calls(ex):
    return [(c.name, json.loads(c.arguments)) for c in ex.tool_calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_output(name, text, content, calls):
    ex = get_tool_parser(name).extract(text)
    assert ex.content == content
    assert _calls(ex) == calls
    assert all(c.id.startswith("chatcmpl-tool-") for c in ex.tool_calls)


def _stream(name: str, pieces: list[str]):
    """Content and calls as the openai client reassembles them from the deltas."""
    s = get_tool_parser(name).streamer()
    content, deltas = [], []
    for p in pieces:
        c, d = s.feed(p)
        content.append(c)
        deltas += d
    c, d = s.finish()
    content.append(c)
    deltas += d
    calls: dict[int, dict] = {}
    for d in deltas:
        assert isinstance(d, ToolCallDelta)
        call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id is not None:  # id and name once, first
            assert call["id"] is None and d.name and call["arguments"] == ""
            call["id"], call["name"] = d.id, d.name
        else:
            assert call["id"] is not None and d.name is None
        call["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [(calls[i]["name"], json.loads(calls[i]["arguments"]))
                              for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_at_every_split_point(name, text, content, calls):
    for i in range(len(text) + 1):  # two pieces, every split point
        assert _stream(name, [text[:i], text[i:]]) == (content or "", calls), i
    assert _stream(name, list(text)) == (content or "", calls)  # a character a delta
    step = max(1, len(text) // 12)
    for i, j in itertools.combinations(range(0, len(text) + 1, step), 2):  # three pieces
        assert _stream(name, [text[:i], text[i:j], text[j:]]) == (content or "", calls), (i, j)


def test_arguments_go_out_in_pieces_before_the_call_ends():
    """The name goes out as soon as it is read, the arguments as they are generated."""
    s = get_tool_parser("hermes").streamer()
    _, d = s.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [(x.name, x.arguments) for x in d] == [("get_weather", ""), (None, '{"ci')]
    _, d = s.feed('ty": "Paris"}}</tool')
    assert [x.arguments for x in d] == ['ty": "Paris"}']  # the outer brace is not an argument
    assert s.finish() == ("", [])


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="hermes, llama3_json, got 'nope'"):
        get_tool_parser("nope")
