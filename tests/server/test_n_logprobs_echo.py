"""``n``, logprobs, echo, several prompts and the tokenizer endpoints through the HTTP API, with
the official ``openai`` client and httpx (the embedded model in float32)."""
from __future__ import annotations

import json
import math

import pytest

PROMPT = "The capital of France is"


def _stream(http, path, body) -> list[dict]:
    with http.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_n2(http, stream):
    body = {"prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 0}
    if stream:
        evs = _stream(http, "/v1/completions", {**body,
                                                "stream_options": {"include_usage": True}})
        texts, reasons = {0: "", 1: ""}, {}
        for ev in evs[:-1]:
            for c in ev["choices"]:
                texts[c["index"]] += c["text"]
                if c["finish_reason"]:
                    reasons[c["index"]] = c["finish_reason"]
        usage = evs[-1]["usage"]
    else:
        # stream_options without a stream: 400, as vLLM
        bad = http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        d = r.json()
        assert [c["index"] for c in d["choices"]] == [0, 1]
        texts = {c["index"]: c["text"] for c in d["choices"]}
        reasons = {c["index"]: c["finish_reason"] for c in d["choices"]}
        usage = d["usage"]
    assert texts[0] == texts[1] and texts[0]  # greedy: the same text twice
    assert reasons == {0: "length", 1: "length"}
    n_prompt = len(http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    assert usage["prompt_tokens"] == n_prompt  # once, not per choice
    assert usage["completion_tokens"] == 10


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n2(http, stream):
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "n": 2,
            "seed": 3, "ignore_eos": True}
    if stream:
        evs = _stream(http, "/v1/chat/completions", body)
        roles = [c["index"] for ev in evs for c in ev["choices"] if c["delta"].get("role")]
        assert sorted(roles) == [0, 1]  # one role chunk per choice
        done = {c["index"]: c["finish_reason"] for ev in evs for c in ev["choices"]
                if c["finish_reason"]}
        assert set(done) == {0, 1}
    else:
        d = http.post("/v1/chat/completions", json=body).json()
        assert [c["index"] for c in d["choices"]] == [0, 1]
        assert all(c["message"]["role"] == "assistant" for c in d["choices"])
        assert [c["finish_reason"] for c in d["choices"]] == ["length", "length"]
        assert d["usage"]["completion_tokens"] == 8  # summed over the choices


def test_n3_seed_gives_different_reproducible_samples(client, live_server):
    def go():
        r = client.completions.create(model=live_server.model, prompt="Once upon a time",
                                      max_tokens=12, n=3, seed=1234, temperature=1.0)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    a, b = go(), go()
    assert a == b                      # reproducible
    assert len(set(a)) == 3            # and different from each other


def test_completions_logprobs_3(client, live_server):
    r = client.completions.create(model=live_server.model, prompt=PROMPT, max_tokens=4,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and tok in top and top[tok] == val
        assert 3 <= len(top) <= 4          # the chosen token plus the top 3 (deduplicated)
        assert max(top.values()) == val    # greedy: the chosen token is the most likely


@pytest.mark.parametrize("k", [3, 5])
def test_chat_logprobs_top_k(client, live_server, k):
    r = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=5, logprobs=True, top_logprobs=k, temperature=1.0, seed=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == k                        # exactly k
        vals = [t.logprob for t in c.top_logprobs]
        assert vals == sorted(vals, reverse=True)              # sorted
        assert c.logprob <= vals[0] + 1e-6 and c.bytes == list(c.token.encode())
        assert sum(math.exp(v) for v in vals) <= 1 + 1e-5


def test_echo_loglikelihood_request_like_lm_eval(http):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 1, token ids."""
    ids = http.post("/tokenize", json={"prompt": PROMPT + " Paris"}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": [ids], "echo": True, "logprobs": 1,
                                           "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1           # the prompt, then one new token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert r.json()["choices"][0]["text"].startswith(text)
    # " Paris" after "The capital of France is" is the model's greedy choice
    last = lp["top_logprobs"][len(ids) - 1]
    assert lp["token_logprobs"][len(ids) - 1] == max(last.values())
    # and equals the logprob the same continuation gets when sampled
    ctx = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    s = http.post("/v1/completions", json={"prompt": ctx, "max_tokens": 1, "temperature": 0,
                                           "logprobs": 0}).json()
    assert abs(s["choices"][0]["logprobs"]["token_logprobs"][0]
               - lp["token_logprobs"][len(ids) - 1]) < 1e-3


def test_several_prompts_with_n(http):
    d = http.post("/v1/completions", json={"prompt": ["Hello", "Goodbye"], "n": 2,
                                           "max_tokens": 3, "temperature": 0}).json()
    assert [c["index"] for c in d["choices"]] == [0, 1, 2, 3]
    t = [c["text"] for c in d["choices"]]
    assert t[0] == t[1] and t[2] == t[3]
    single = http.post("/v1/completions", json={"prompt": "Goodbye", "max_tokens": 3,
                                                "temperature": 0}).json()["choices"][0]["text"]
    assert t[2] == single


def test_echo_without_logprobs_returns_the_prompt_first(http):
    d = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 2,
                                           "temperature": 0}).json()
    assert d["choices"][0]["text"].startswith(PROMPT) and d["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_token_ids_honours_skip_special_tokens(http, engine, helpers, stream):
    """A token-id prompt is echoed as the output is decoded: without special tokens by default
    (skip_special_tokens true, as in vLLM), with them when the request turns it off."""
    hf = engine.tokenizer.hf
    start, end = hf.convert_tokens_to_ids("<|im_start|>"), hf.convert_tokens_to_ids("<|im_end|>")
    ids = [start] + http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"] + [end]
    base = {"prompt": ids, "max_tokens": 2, "temperature": 0}

    def text(**kw) -> str:
        if not stream:
            r = http.post("/v1/completions", json=dict(base, **kw))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json=dict(base, stream=True, **kw)) as r:
            assert r.status_code == 200
            events = helpers.sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    completion = text()
    assert text(echo=True) == "Hello" + completion
    raw = text(echo=True, skip_special_tokens=False)
    assert raw.startswith("<|im_start|>Hello<|im_end|>"), raw


def test_tokenize_detokenize_round_trip_and_errors(http, live_server):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"]
    bad = http.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
    assert http.post("/tokenize", json={}).status_code == 400
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_returned(http, stream):
    """``prompt_logprobs`` alone (vLLM's field) used to be computed (skipping the prefix cache)
    and then dropped: every choice has them now, in vLLM's shape (None for the first prompt
    token, then per token id its logprob, rank and text), the same as echo's prompt part."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    if stream:
        evs = _stream(http, "/v1/completions", body)
        plps = {c["index"]: c["prompt_logprobs"] for ev in evs for c in ev["choices"]
                if c.get("prompt_logprobs") is not None}
    else:
        d = http.post("/v1/completions", json=body).json()
        plps = {c["index"]: c["prompt_logprobs"] for c in d["choices"]}
    # computed once for the prompt (by choice 0) and given to both choices: equal exactly
    assert set(plps) == {0, 1} and plps[0] == plps[1]
    plp = plps[0]
    assert len(plp) == len(ids) and plp[0] is None
    echo = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                              "echo": True, "logprobs": 2}).json()
    elp = echo["choices"][0]["logprobs"]
    assert echo["choices"][0]["prompt_logprobs"] is None  # not asked for
    for i in range(1, len(ids)):
        entry = plp[i]
        own = entry[str(ids[i])]
        assert next(iter(entry)) == str(ids[i])  # the prompt's own token first
        assert abs(own["logprob"] - elp["token_logprobs"][i]) < 1e-4
        assert own["decoded_token"] == elp["tokens"][i] and own["rank"] >= 1
        assert {e["rank"] for e in entry.values()} >= {1, 2} and 2 <= len(entry) <= 3


def test_n_choices_compute_the_prompt_logprobs_once(http):
    """The prompt's logprobs are computed by its first choice alone: its sibling asks for none,
    so it starts from the first one's cached prompt blocks (a request computing prompt logprobs
    takes none from the cache) and answers with the first one's values."""
    prompt = "Once upon a time in a land far away, there lived a king who had three daughters. " * 2
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(ids) > 32
    d = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 0, "n": 2}).json()
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    a, b = (c["prompt_logprobs"] for c in d["choices"])
    assert a == b and len(a) == len(ids)


class _SiblingFirstEngine:
    """Yields the outputs of a group in a fixed order: choice 1 finishes before choice 0 (the
    one that computes the prompt's logprobs) sends anything."""

    def __init__(self, order):
        self.order = order

    async def generate_group(self, requests, reservation=None):
        for i, out in self.order:
            yield i, out


def test_prompt_logprobs_are_computed_once_and_wait_for_in_a_stream():
    """Only the prompt's first choice asks the engine for its logprobs; a sibling whose outputs
    arrive first is held until they came, then streams them as its own (the same object)."""
    import asyncio

    from sloserve.engine.messages import EngineCoreRequest
    from sloserve.engine.outputs import RequestOutput
    from sloserve.logprobs import Logprobs
    from sloserve.sampling_params import SamplingParams
    from sloserve.server.logprobs_format import LogprobsFormatter
    from sloserve.server.serving import Choice, CompletionBuilder, _events

    prompt = [7, 8, 9]
    lp = Logprobs([[8, 3], [9, 9]], [[-1.5, -0.5], [-0.25, -0.25]], [2, 1])
    with_lp = SamplingParams(max_tokens=2, prompt_logprobs=1)
    choices = [Choice(EngineCoreRequest(f"r-{i}", prompt, sp, 0.0), 0)
               for i, sp in enumerate((with_lp, SamplingParams(max_tokens=2)))]
    choices.append(Choice(EngineCoreRequest("other", [5, 6], with_lp, 0.0), 1))

    def out(rid, tok, first, finished, plp=None):
        return RequestOutput(rid, f"t{tok}", [tok], "", finished=finished,
                             finish_reason="length" if finished else None,
                             prompt_token_ids=prompt if first else None, prompt_logprobs=plp)

    order = [(1, out("r-1", 4, True, False)), (1, out("r-1", 5, False, True)),
             (2, out("other", 6, True, True, Logprobs([[6]], [[-2.0]], [4]))),
             (0, out("r-0", 4, True, False, lp)), (0, out("r-0", 5, False, True))]
    b = CompletionBuilder("cmpl-x", 0, "m", LogprobsFormatter(None), prompt_logprobs=True)

    async def collect():
        return [ev async for ev in _events(_SiblingFirstEngine(order), choices, False, b)]

    evs = [json.loads(e[6:]) for e in asyncio.run(collect()) if e.startswith("data: {")]
    seq = [(c["index"], c["text"]) for ev in evs for c in ev["choices"]]
    # choice 2 (another prompt, its own logprobs) is not held; choice 1 waits for choice 0
    assert seq == [(2, "t6"), (0, "t4"), (1, "t4"), (1, "t5"), (0, "t5")]
    plps = {c["index"]: c["prompt_logprobs"] for ev in evs for c in ev["choices"]
            if c.get("prompt_logprobs") is not None}
    assert plps[0] == plps[1] == [None, {"8": {"logprob": -1.5, "rank": 2,
                                                "decoded_token": "token_id:8"},
                                         "3": {"logprob": -0.5, "rank": 1,
                                               "decoded_token": "token_id:3"}},
                                  {"9": {"logprob": -0.25, "rank": 1,
                                         "decoded_token": "token_id:9"}}]
    assert plps[2][1]["6"]["rank"] == 4


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": PROMPT, "n": True}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": False}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": True}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "seed": False}, "seed"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [7, True]]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": True}, "n"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
])
def test_booleans_in_integer_fields_are_400(http, path, body, param):
    """pydantic's lax mode read JSON true / false as 1 / 0 before the server's own bool checks
    ran: ``n: true`` gave one choice and ``logprobs: false`` returned logprobs."""
    if path != "/detokenize":
        body = dict(body, max_tokens=body.get("max_tokens", 2))
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "boolean" in err["message"], err


def test_streamed_text_offsets_equal_the_whole_responses_and_never_go_back(http):
    """Streamed chunks used to start their text_offset at the characters of text sent so far,
    while within a chunk (and in the whole response) each offset follows the previous token's
    text: with characters split over several tokens (each shown as U+FFFD) the offsets went
    backwards between chunks and differed from the non-streamed answer."""
    body = {"prompt": "I love 😀🎉 and 日本語", "max_tokens": 8, "temperature": 0,
            "logprobs": 1, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    offsets, tokens = [], []
    for ev in _stream(http, "/v1/completions", body):
        for c in ev["choices"]:
            if c["logprobs"]:
                offsets += c["logprobs"]["text_offset"]
                tokens += c["logprobs"]["tokens"]
    assert tokens == whole["tokens"]
    assert offsets == whole["text_offset"]
    assert offsets == sorted(offsets)


def test_a_long_tokenize_does_not_block_the_event_loop(http, live_server, monkeypatch):
    """/tokenize ran the tokenizer on the event loop: a 5 MB prompt froze /health and every
    stream of the server for seconds (completions already tokenize long text in a thread).

    Deterministic: the tokenizer's encode is held (on an event) while /health is asked three
    times; each answer must come while encode is still held, which a loop running encode itself
    cannot do (it answers only once encode returns, if before the client's 60 s timeout)."""
    import threading

    import httpx
    tok = live_server.engine.tokenizer  # what /tokenize encodes with
    text = "word " * 100_000  # 500 KB: a long text (the server offloads over 20,000 chars)
    want = len(tok.encode(text))
    entered, release = threading.Event(), threading.Event()
    held = {"now": False, "timed_out": False}
    encode = tok.encode

    def held_encode(t, *a, **kw):
        if t is not text and t != text:
            return encode(t, *a, **kw)
        held["now"] = True
        entered.set()
        try:
            if not release.wait(60):  # a hang guard
                held["timed_out"] = True
                raise RuntimeError("encode held 60 s")
        finally:
            held["now"] = False
        return encode(t, *a, **kw)

    monkeypatch.setattr(tok, "encode", held_encode)
    done = {}

    def big():
        done["r"] = httpx.post(live_server.base_url + "/tokenize", json={"prompt": text},
                               timeout=120)

    t = threading.Thread(target=big)
    t.start()
    try:
        assert entered.wait(60), "/tokenize did not reach the tokenizer"
        for _ in range(3):  # answered while /tokenize's encode is still held
            assert http.get("/health", timeout=60).status_code == 200
            assert held["now"] and not held["timed_out"], held
    finally:
        release.set()
        t.join(timeout=120)
    assert not t.is_alive()
    r = done["r"]
    assert r.status_code == 200, r.text
    assert r.json()["count"] == want >= 100_000
