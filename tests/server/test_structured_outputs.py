"""Structured outputs (xgrammar token masks) through the HTTP API: response_format json_object /
json_schema (the openai client's ``parse`` with a pydantic model), vLLM's structured_outputs
choice / regex / grammar, with n, with chunked prefill and preemption, and the 400s."""
from __future__ import annotations

import json
import re
import time

import httpx
import pydantic
import pytest

from sloserve.config import EngineConfig


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=150)


def test_openai_parse_50_prompts_gives_50_valid_objects(live_server):
    """The official client's ``chat.completions.parse`` sends the pydantic model as a strict
    json_schema; all 50 answers (sampled, sent at once so they batch) parse into it."""
    import asyncio

    import openai

    names = ["a pilot", "a baker", "a child", "a poet", "a doctor"]

    async def go():
        async with openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key="x",
                                      max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(c.chat.completions.parse(
                model=live_server.model, response_format=Person, max_tokens=64,
                temperature=1.0, seed=i,
                messages=[{"role": "user", "content": f"Describe {names[i % 5]} as JSON."}])
                for i in range(50)))

    results = asyncio.run(go())
    parsed = [r.choices[0].message.parsed for r in results]
    assert all(isinstance(p, Person) for p in parsed)
    assert len(parsed) == 50 and len({p.model_dump_json() for p in parsed}) > 1


def test_json_object_with_n_and_streaming(http):
    body = {"prompt": "A JSON object:", "max_tokens": 64, "n": 2, "temperature": 0.8, "seed": 1,
            "response_format": {"type": "json_object"}, "stream": True}
    texts = {0: "", 1: ""}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                for c in json.loads(ln[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    for t in texts.values():  # finished ones parse; one cut at max_tokens is still a prefix
        try:
            assert isinstance(json.loads(t), dict)
        except json.JSONDecodeError:
            assert t.lstrip().startswith("{"), t


@pytest.mark.parametrize("spec,check", [
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"grammar": 'root ::= "(" [a-z]+ ")"'}, lambda t: re.fullmatch(r"\([a-z]+\)", t)),
    ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}},
     lambda t: json.loads(t).keys() == {"ok"}),
])
def test_structured_outputs_field(http, spec, check):
    for seed in range(3):
        d = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 24,
                                               "temperature": 1.0, "seed": seed,
                                               "structured_outputs": spec}).json()
        c = d["choices"][0]
        assert c["finish_reason"] == "stop" and check(c["text"]), c


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format"),
    # compiles, but xgrammar would drop the keyword: refused (as vLLM does)
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"structured_outputs": {"json": {"not": {"type": "null"}}}}, "structured_outputs"),
])
def test_bad_specs_400(http, body, param):
    r = http.post("/v1/completions", json=dict(body, prompt="x", max_tokens=4))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]


@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_non_local_ref_is_400_naming_the_ref(http, field):
    """A remote $ref was compiled with the reference left unconstrained (xgrammar only logs a
    warning): refused, naming the param and the reference; nothing is fetched."""
    schema = {"type": "object", "properties": {"a": {"$ref": "http://example.com/x"}}}
    spec = ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            if field == "response_format" else {"json": schema})
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, field: spec})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "BadRequestError" and err["code"] == 400
    assert '"http://example.com/x"' in err["message"] and "/properties/a" in err["message"]
    assert "not a local reference" in err["message"]


def test_grammar_survives_chunked_prefill_and_preemption(helpers):
    """A tiny KV cache and a small token budget: long prompts are chunked and requests are
    preempted and recomputed; every constrained answer still matches its regex."""
    import asyncio

    from sloserve.sampling_params import SamplingParams, StructuredOutputsParams
    srv = helpers.start_server(EngineConfig(model=None, dtype="float32", num_kv_blocks=24,
                                    max_model_len=256, max_num_batched_tokens=32))
    try:
        eng = srv.engine
        pattern = "([a-z]+ ){20,30}"

        async def one(i: int):
            sp = SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=
                                StructuredOutputsParams(regex=pattern))
            req = eng.make_request("word " * (80 + 10 * i), sp)
            return [o async for o in eng.generate(req)]

        async def go():
            return await asyncio.gather(*(one(i) for i in range(6)))

        runs = asyncio.run(go())
        assert eng.stats.num_preemptions_total > 0
        for outs in runs:
            assert outs[-1].finish_reason in ("stop", "length")
            text = outs[-1].text
            assert re.fullmatch(pattern, text) or (outs[-1].finish_reason == "length"
                                                   and re.fullmatch("([a-z]+ )*[a-z]*", text)), text
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_complete_grammar_with_ignore_eos_finishes_and_the_core_survives(http, helpers, engine,
                                                                         stream):
    """A grammar that accepted its stop token allows no further token: with ``ignore_eos`` the
    core used to ask the finished matcher for the next mask, which raised in the step loop and
    killed the engine core process (every later request 503)."""
    body = {"prompt": "Answer:", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "structured_outputs": {"choice": ["yes", "no"]}, "logprobs": 0}
    if stream:
        with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            data = helpers.sse_events(r.iter_lines())
        assert data[-1] == "[DONE]" and not any('"error"' in d for d in data), data
        evs = [json.loads(d) for d in data[:-1]]
        text = "".join(c["text"] for ev in evs for c in ev.get("choices", ()))
        reason = [c["finish_reason"] for ev in evs for c in ev.get("choices", ())
                  if c["finish_reason"]]
        assert reason == ["stop"], evs
    else:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        text, reason = c["text"], c["finish_reason"]
        assert reason == "stop"
    assert text in ("yes", "no")
    assert http.get("/health").status_code == 200
    helpers.wait_all_blocks_free(engine)


def test_unsatisfiable_grammar_fails_only_its_own_request(http, helpers, engine):
    """A regex no string matches (the mask allows no token, not even EOS): sampled, the row of
    all -inf logits used to make torch.multinomial raise, failing every request of the step;
    greedy, it returned masked tokens until max_tokens. Now that request alone fails, naming
    the reason, with a 400 (the spec is the client's: vLLM's users get a 400 for a spec it
    refuses), and a request running beside it is unaffected."""
    import threading
    neighbour = {}

    def run():
        neighbour["r"] = httpx.post(http.base_url.join("/v1/completions"), timeout=120, json={
            "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0})

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    for temperature in (1.0, 0):
        r = http.post("/v1/completions", json={
            "prompt": "Answer:", "max_tokens": 16, "temperature": temperature,
            "structured_outputs": {"regex": "ab[^\\s\\S]"}})
        assert r.status_code == 400, r.text
        assert "cannot be satisfied" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "BadRequestError"
    r = http.post("/v1/completions", json={  # streamed: the headers went out, so an error event
        "prompt": "Answer:", "max_tokens": 16, "stream": True,
        "structured_outputs": {"regex": "ab[^\\s\\S]"}})
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "BadRequestError" and "cannot be satisfied" in err["message"]
    t.join()
    assert neighbour["r"].status_code == 200, neighbour["r"].text
    assert neighbour["r"].json()["choices"][0]["finish_reason"] == "length"
    assert http.get("/health").status_code == 200
    helpers.wait_all_blocks_free(engine)


@pytest.mark.parametrize("field,param", [
    ('"structured_outputs": {"choice": ["ok", "\\ud800"]}', "structured_outputs"),
    ('"cache_salt": "\\udfff"', "cache_salt"),
])
def test_lone_surrogates_in_a_choice_or_cache_salt_are_400(http, engine, helpers, field, param):
    """Valid JSON escapes that are not valid UTF-8 passed validation (a choice is quoted as
    ASCII-escaped JSON for xgrammar) and failed when the request was encoded for the core: a
    500. They are a 400 now, like lone surrogates in stop strings."""
    body = '{"prompt": "Answer:", "max_tokens": 4, ' + field + '}'
    r = http.post("/v1/completions", content=body.encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]
    helpers.wait_all_blocks_free(engine)


def wide_schema(prefix: str, n: int = 2000) -> dict:
    """An object of ``n`` optional integer properties: its grammar takes tens of seconds of CPU
    to compile (the session server's --structured-outputs-compile-timeout is 1 s)."""
    return {"type": "object",
            "properties": {f"{prefix}{i:04d}": {"type": "integer"} for i in range(n)}}


def wait_until(cond, what: str, timeout: float = 300.0) -> None:
    """Poll ``cond`` (a hang guard: ``timeout`` is not a speed bound)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: still not after {timeout} s"
        time.sleep(0.02)


def test_compiles_are_capped_per_client_and_one_over_its_limit_fails_alone(http, engine,
                                                                           helpers):
    """A client's two wide schemas compile in the engine core's low-priority workers; its third
    new grammar meanwhile is a 429 naming --max-pending-compiles-per-client (2, the default),
    while another client's new grammar and a plain request are served; the two then fail alone
    with a 400 naming --structured-outputs-compile-timeout and its value, and the server serves
    on with no compile work left."""
    import threading

    from tests.server.conftest import COMPILE_TIMEOUT_S
    results: dict[str, httpx.Response] = {}

    def ask(prefix: str) -> None:
        results[prefix] = httpx.post(http.base_url.join("/v1/completions"), timeout=300, json={
            "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": wide_schema(prefix)}})

    threads = [threading.Thread(target=ask, args=(p,)) for p in "ab"]
    for t in threads:
        t.start()
    wait_until(lambda: engine.compile_slots.pending("127.0.0.1") == 2, "two compiles pending")
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                           "structured_outputs": {"json": wide_schema("c")}})
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    err = r.json()["error"]
    assert err["type"] == "RateLimitError" and "(--max-pending-compiles-per-client)" in err["message"]
    # another client (a proxy on 127.0.0.1 names it) has its own count
    r = http.post("/v1/completions", headers={"X-Forwarded-For": "10.9.8.7"}, json={
        "prompt": "Answer:", "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}"}})
    assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"])
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                           "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    for t in threads:
        t.join()
    for p in "ab":
        assert results[p].status_code == 400, results[p].text
        err = results[p].json()["error"]
        assert err["type"] == "BadRequestError"
        assert f"(--structured-outputs-compile-timeout {COMPILE_TIMEOUT_S:g})" in err["message"]
    assert http.get("/health").status_code == 200
    wait_until(lambda: engine.stats.num_grammar_compiles == 0, "no compile left")
    assert engine.compile_slots.pending("127.0.0.1") == 0
    helpers.wait_all_blocks_free(engine)


def test_the_compile_of_a_client_that_went_away_is_stopped(http, engine, helpers):
    with http.stream("POST", "/v1/completions", json={
            "prompt": "x", "max_tokens": 4, "stream": True,
            "structured_outputs": {"json": wide_schema("d")}}) as r:
        assert r.status_code == 200
        wait_until(lambda: engine.stats.num_grammar_compiles == 1, "compile running")
    # the connection is closed: the request is aborted and its compile killed
    wait_until(lambda: engine.stats.num_grammar_compiles == 0 and not engine.num_unfinished,
               "compile stopped")
    assert http.get("/metrics").text.count('sloserve:grammar_compiles{model_name=') == 1
    helpers.wait_all_blocks_free(engine)
