"""schemathesis against the server's own OpenAPI document: every operation, examples generated
from the schema (which states the real limits: ``sloserve.server.openapi``), bounded by example
count and by caps on ``max_tokens`` / ``n`` so a case costs at most a few decode steps.

Checks: no 5xx; every 4xx carries its API's error body (OpenAI's; Anthropic's on /v1/messages);
the server is healthy and answers
a normal request the same way afterwards. The status counts are printed (``-s`` shows them):
the share of 200s says how often the engine itself was reached.
"""
from __future__ import annotations

import collections
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

EXAMPLES = 15          # per operation
MAX_TOKENS, MAX_N = 4, 2
#: operations not fuzzed: reset_prefix_cache would change the server for the others, and
#: /stats/stream is an endless event stream (both tested elsewhere)
SKIP = {"POST /reset_prefix_cache", "GET /stats/stream"}


def _cap(case) -> None:
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = max(1, min(body[key], MAX_TOKENS))
        if "input" in body:  # the Responses API's: null means "up to max_model_len"
            if body.get("max_output_tokens") is None:
                body["max_output_tokens"] = MAX_TOKENS
        elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # null means "up to max_model_len"
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
            body["n"] = max(1, min(body["n"], MAX_N))
        if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(
                body["prompt"][0], (str, list)):
            body["prompt"] = body["prompt"][:2]


def test_fuzz_every_operation(live_server, http):
    base = live_server.base_url
    ref = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    before = http.post("/v1/completions", json=ref).json()["choices"][0]["text"]
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    counts: collections.Counter = collections.Counter()
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {o.label for o in ops} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                      "POST /tokenize", "POST /detokenize", "GET /v1/models"}
    with httpx.Client(base_url=base, timeout=120) as c:
        for op in ops:
            if op.label in SKIP:
                continue

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy())
            def run(case):
                _cap(case)
                kw = case.as_transport_kwargs(base_url=base)
                r = c.request(kw["method"], kw["url"], json=kw.get("json"),
                              params=kw.get("params"), headers={"content-type": "application/json"})
                counts[r.status_code] += 1
                per_op[op.label][r.status_code] += 1
                if r.status_code >= 500:
                    failures.append(f"{op.label} -> {r.status_code}: {json.dumps(kw.get('json'))[:4000]} "
                                    f"{r.text[:300]}")
                elif r.status_code >= 400:
                    body = r.json() if r.headers.get(
                        "content-type", "").startswith("application/json") else {}
                    err = body.get("error")
                    if op.label.startswith("POST /v1/messages"):  # Anthropic's error shape
                        ok = (body.get("type") == "error" and isinstance(err, dict)
                              and err.get("message") and err.get("type"))
                    else:
                        ok = (isinstance(err, dict) and err.get("message")
                              and err.get("code") == r.status_code and "type" in err)
                    if not ok:
                        failures.append(f"{op.label} -> {r.status_code} without its API's "
                                        f"error body: {r.text[:300]}")

            run()
    print(f"\nschemathesis: {sum(counts.values())} cases, status counts {dict(counts)}; "
          f"per operation: { {k: dict(v) for k, v in per_op.items()} }")
    assert not failures, failures[:5]
    assert counts[200] >= 0.3 * sum(counts.values()), dict(counts)  # the engine was reached
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=ref).json()["choices"][0]["text"] == before


@pytest.mark.parametrize("field,value", [("model", "SmolLM2-135M-Instruct")])
def test_schema_states_the_served_model_and_limits(http, field, value):
    doc = http.get("/openapi.json").json()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"enum": [value], "type": "string"} in props[field]["anyOf"]
    n = [b for b in props["n"]["anyOf"] if b.get("type") == "integer"][0]
    assert (n["minimum"], n["maximum"]) == (1, 128)
    lp = [b for b in props["logprobs"]["anyOf"] if b.get("type") == "integer"][0]
    assert lp["maximum"] == 20
