"""OpenAI-compatible endpoints through the official client: completions, chat, streaming, stop
strings, usage, multi-byte text."""
from __future__ import annotations

import json

import pytest

from sloserve.sampling_params import SamplingParams

PROMPT = "Once upon a time"


def _stream_completion(client, model, **kw):
    chunks = list(client.completions.create(model=model, stream=True, **kw))
    return chunks


def test_models_and_health(client, http, live_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [live_server.model]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert http.get("/health").status_code == 200
    assert http.head("/health").status_code == 200  # load balancers probe with HEAD


def test_completion_greedy_stream_equals_nonstream(client, live_server, engine):
    model = live_server.model
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert isinstance(resp.created, int) and resp.model == model
    (choice,) = resp.choices
    assert choice.finish_reason == "length" and choice.text
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.usage.total_tokens == n_prompt + 8

    chunks = _stream_completion(client, model, prompt=PROMPT, max_tokens=8, temperature=0,
                                stream_options={"include_usage": True})
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n_prompt, 8)
    assert all(c.usage is None for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c.choices[0].text for c in content[:-1]), "empty deltas must not be sent"
    assert "".join(c.choices[0].text for c in content) == choice.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http, live_server, engine):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): each content chunk of
    completions and chats carries the usage so far; the final usage chunk the totals."""
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    for path, req in (("/v1/completions", {"prompt": PROMPT}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        with http.stream("POST", path, json={
                "model": live_server.model, **req, "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.iter_lines()
                      if ln.startswith("data: {")]
        *content, last = events
        content = [e for e in content if e["usage"] is not None]
        done = [e["usage"]["completion_tokens"] for e in content]
        assert done == sorted(done) and done[-1] == 5 and done[0] >= 1
        prompts = {e["usage"]["prompt_tokens"] for e in content}
        assert len(prompts) == 1 and last["choices"] == []
        assert last["usage"]["completion_tokens"] == 5
        assert last["usage"]["prompt_tokens"] == prompts.pop()
        if path == "/v1/completions":
            assert last["usage"]["prompt_tokens"] == n_prompt
            assert all(e["usage"] is not None for e in events)


def test_completion_raw_sse_format(http, live_server):
    with http.stream("POST", "/v1/completions", json={
            "model": live_server.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    # no usage chunk without include_usage
    assert all(p["choices"] for p in payloads)


def test_completion_token_id_prompt(client, live_server, engine):
    ids = engine.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=4,
                                        temperature=0)
    by_ids = client.completions.create(model=live_server.model, prompt=ids, max_tokens=4,
                                       temperature=0)
    one_in_list = client.completions.create(model=live_server.model, prompt=[PROMPT],
                                            max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == one_in_list.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_stream_equals_nonstream(client, live_server, engine):
    model = live_server.model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    n_prompt = len(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                          temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == n_prompt and resp.usage.completion_tokens == 6

    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == n_prompt
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].delta.content for c in content[1:-1]), "empty deltas must not be sent"
    joined = "".join(c.choices[0].delta.content or "" for c in content)
    assert joined == choice.message.content


def _token_pieces(engine, ids: list[int]) -> list[str]:
    tok = engine.tokenizer
    pieces, prev = [], ""
    for i in range(len(ids)):
        cur = tok.decode(ids[:i + 1])
        pieces.append(cur[len(prev):])
        prev = cur
    return pieces


def _pick_stops(ref: str, pieces: list[str]) -> tuple[str, int, str, int]:
    """(stop ending inside a token, its cut position, stop spanning two tokens, its cut)."""
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    inside = span = None
    for i, p in enumerate(pieces):
        if i == 0 or not p.isascii():
            continue
        if inside is None and len(p.strip()) >= 4 and p.strip().isalpha():
            s = p[:3]
            if ref.find(s) == starts[i]:
                inside = (s, starts[i])
        if span is None and i + 1 < len(pieces) and len(p) >= 2 and len(pieces[i + 1]) >= 2 \
                and pieces[i + 1].isascii():
            s = p[-2:] + pieces[i + 1][:2]
            if ref.find(s) == starts[i] + len(p) - 2:
                span = (s, starts[i] + len(p) - 2)
    assert inside and span, f"no suitable stop strings in {pieces}"
    return inside[0], inside[1], span[0], span[1]


def test_stop_strings_inside_token_and_across_tokens(client, live_server, engine, helpers):
    model = live_server.model
    outs = helpers.generate(engine, PROMPT, SamplingParams(temperature=0, max_tokens=16))
    ref = "".join(o.new_text for o in outs)
    ids = outs[-1].token_ids
    pieces = _token_pieces(engine, ids)
    assert "".join(pieces) == ref
    stop_in, cut_in, stop_span, cut_span = _pick_stops(ref, pieces)
    for stop, cut in ((stop_in, cut_in), (stop_span, cut_span)):
        expected = ref[:cut]
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                         temperature=0, stop=[stop])
        assert resp.choices[0].text == expected, (stop, ref)
        assert resp.choices[0].finish_reason == "stop"
        chunks = _stream_completion(client, model, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=stop)
        joined = "".join(c.choices[0].text for c in chunks)
        assert joined == expected, (stop, [c.choices[0].text for c in chunks])
        assert stop not in joined
        assert chunks[-1].choices[0].finish_reason == "stop"


CJK = "你好，世界 😀🎉"


def test_chinese_and_emoji_stream_without_replacement_chars(client, live_server):
    model = live_server.model
    prompt = f"{CJK}\n{CJK}\n{CJK}\n"
    chunks = _stream_completion(client, model, prompt=prompt, max_tokens=12, temperature=0)
    deltas = [c.choices[0].text for c in chunks]
    joined = "".join(deltas)
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "\ufffd" not in joined
    assert any(not ch.isascii() for ch in joined), f"expected multi-byte output, got {joined!r}"
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert resp.choices[0].text == joined


def test_seeded_sampling_is_reproducible(client, live_server):
    kw = dict(model=live_server.model, prompt=PROMPT, max_tokens=5, temperature=1.0, top_p=0.9,
              seed=1234, extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_ignore_eos_and_stop_token_ids(client, live_server, engine, helpers):
    outs = helpers.generate(engine, PROMPT, SamplingParams(temperature=0, max_tokens=4))
    ids = outs[-1].token_ids
    resp = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=4,
                                     temperature=0, extra_body={"stop_token_ids": [ids[2]]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == ids.index(ids[2]) + 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_model_field_optional(http, path):
    body = {"max_tokens": 2, "temperature": 0}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    else:
        body["prompt"] = "Hi"
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
