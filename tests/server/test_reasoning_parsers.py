"""Reasoning parsers on recorded texts, whole and streamed at every split point; with a tool
parser behind them (the public failure: streamed tool calls lost when both run), every call
arrives whole over 20 seeded random splittings."""
from __future__ import annotations

import json
import random

import pytest

from sloserve.server.reasoning_parsers import get_reasoning_parser
from sloserve.server.tool_parsers import get_tool_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <3", "days": [1, 2]}}\n</tool_call>'

CASES = [  # parser, text, reasoning, content
    ("deepseek_r1", "<think>Paris is in France.</think>It is sunny.", "Paris is in France.", "It is sunny."),
    ("deepseek_r1", "the template opened it</think>\n\nAnswer", "the template opened it", "\n\nAnswer"),
    ("deepseek_r1", "still thinking when max_tokens hit", "still thinking when max_tokens hit", None),
    ("deepseek_r1", f"<think>I should call it.</think>{CALL}", "I should call it.", CALL),
    ("qwen3", "<think>a < b </thin k</think>ok", "a < b </thin k", "ok"),
    ("qwen3", "No thinking here, 1 </think> 2", None, "No thinking here, 1 </think> 2"),
    ("qwen3", "\n<think>\nhmm\n</think>\n\nyes", "\nhmm\n", "\n\nyes"),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_whole_and_streamed(name, text, reasoning, content):
    p = get_reasoning_parser(name)
    got = p.extract(text)
    assert (got.reasoning, got.content) == (reasoning, content)
    for i in range(len(text) + 1):
        for pieces in ([text[:i], text[i:]], list(text[:i]) + [text[i:]]):
            s = p.streamer()
            r, c = zip(*[s.feed(x) for x in pieces], s.finish())
            assert ("".join(r), "".join(c)) == (reasoning or "", content or ""), (i, pieces)


def test_tool_calls_after_reasoning_arrive_whole_in_every_streamed_run():
    text = f"<think>The user wants weather. {CALL[:20]} is how I call.</think>Sure.\n{CALL}\n{CALL}"
    want = [("get_weather", {"city": "Paris <3", "days": [1, 2]})] * 2
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(5, 60)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        rs, ts = get_reasoning_parser("deepseek_r1").streamer(), get_tool_parser("hermes").streamer()
        reasoning, content, calls = "", "", {}
        for piece in pieces + [None]:
            r, c = rs.feed(piece) if piece is not None else rs.finish()
            reasoning += r
            tc, deltas = ts.feed(c) if piece is not None else _fed_then_finished(ts, c)
            content += tc
            for d in deltas:
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or d.name
                call["arguments"] += d.arguments
        assert reasoning == f"The user wants weather. {CALL[:20]} is how I call.", seed
        assert content.strip() == "Sure.", seed
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want, seed


def _fed_then_finished(ts, c):
    c1, d1 = ts.feed(c)
    c2, d2 = ts.finish()
    return c1 + c2, d1 + d2


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, got 'x'"):
        get_reasoning_parser("x")
