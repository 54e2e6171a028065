"""The agent APIs through the router over two real replicas (round-robin, so consecutive
requests alternate): Responses turns find the replica that stored their
``previous_response_id``, ``GET /v1/responses/{id}`` finds it too, the Messages API streams
through, and the router's own errors come in each API's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from sloserve.config import EngineConfig
from sloserve.router.config import RouterConfig
from tests.router.stubs import LiveRouter, stop_all

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def replicas(helpers):
    cfg = EngineConfig(model=None, dtype="float32", num_kv_blocks=128, max_model_len=1024,
                       max_num_batched_tokens=256)
    servers = [helpers.start_server(cfg) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def router(replicas):
    # (servers and router share this process's GIL here: a slow /health is not a dead worker)
    r = LiveRouter(RouterConfig(replicas=[s.base_url for s in replicas],
                                routing_policy="round-robin", health_check_timeout=10.0)).start()
    yield r
    stop_all([r])


def _stored_on(replicas, rid: str) -> list[int]:
    """The replicas that store response ``rid``."""
    return [i for i, s in enumerate(replicas)
            if httpx.get(f"{s.base_url}/v1/responses/{rid}").status_code == 200]


def test_responses_turns_follow_their_stored_response(router, replicas):
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = replicas[0].model
    first = c.responses.create(model=model, input="Name a colour.", max_output_tokens=6,
                               temperature=0)
    (home,) = _stored_on(replicas, first.id)
    prev = first
    for turn in range(3):  # round-robin alone would send every other turn elsewhere
        nxt = c.responses.create(model=model, input=f"And another one ({turn})?",
                                 previous_response_id=prev.id, max_output_tokens=6,
                                 temperature=0)
        assert nxt.usage.input_tokens > prev.usage.input_tokens  # the history came along
        assert _stored_on(replicas, nxt.id) == [home]
        prev = nxt
    assert c.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve("resp_nowhere")
    assert "resp_nowhere" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):  # the replica's own 404 passes through
        c.responses.create(model=model, input="x", previous_response_id="resp_nowhere")
    metrics = router.client.get("/metrics").text
    assert 'sloserve_router_routing_decisions_total{decision="holder",policy="pinned"} 3.0' in metrics


def test_messages_whole_streamed_and_counted_through_the_router(router, replicas):
    ac = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0, timeout=120)
    model = replicas[0].model
    kw = dict(model=model, max_tokens=80, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
              tools=[{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}],
              tool_choice={"type": "tool", "name": "get_weather"})
    m = ac.messages.create(**kw)
    use = next(b for b in m.content if b.type == "tool_use")
    with ac.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == m.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"][0] == use.input
    n = ac.messages.count_tokens(model=model, messages=kw["messages"], tools=kw["tools"])
    assert n.input_tokens > 0


def test_the_routers_own_errors_come_in_each_apis_shape(replicas):
    dead = LiveRouter(RouterConfig(replicas=["http://127.0.0.1:9"],
                                   health_check_interval=0.2)).start()
    try:
        dead.wait_for(lambda: not dead.router.pool.available("replica"))
        r = dead.client.post("/v1/messages", json={"model": "m", "max_tokens": 1,
                                                    "messages": []})
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "overloaded_error"
        r = dead.client.post("/v1/messages", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = dead.client.post("/v1/responses", json={"model": "m", "input": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert json.loads(dead.client.get("/v1/responses/resp_x").content)["error"]["code"] == 404
    finally:
        stop_all([dead])


def test_the_router_refuses_an_oversized_body_before_reading_it(replicas):
    """``--max-request-body-bytes`` at the router too: a body announced larger gets 413 in
    the API's shape, nothing forwarded; the router serves on."""
    r = LiveRouter(RouterConfig(replicas=[s.base_url for s in replicas],
                                max_request_body_bytes=1000, health_check_timeout=10.0)).start()
    try:
        big = b'{"model": "m", "input": "' + b"x" * 5000 + b'"}'
        for path, shape in (("/v1/responses", "error"), ("/v1/messages", "type")):
            got = r.client.post(path, content=big, headers={"content-type": "application/json"})
            assert got.status_code == 413 and shape in got.json()
            assert "over the limit of 1000 bytes" in json.dumps(got.json())
        assert r.client.post("/v1/completions", json={"model": replicas[0].model,
                                                      "prompt": "hi", "max_tokens": 1}
                             ).status_code == 200
    finally:
        stop_all([r])
