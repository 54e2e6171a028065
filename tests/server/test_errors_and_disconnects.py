"""Error bodies (OpenAI shape), engine-side failures, and client disconnects freeing KV blocks."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from sloserve.config import EngineConfig

MAX_LEN = 2048  # the session server's max_model_len


def _assert_error(r: httpx.Response, status: int, param: str | None = "__any__",
                  types=("BadRequestError", "invalid_request_error")) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] in types and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


COMPLETION_400 = [
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "n": 129}, "n"),
    ({"prompt": ["Hi"] * 3, "n": 50}, "prompt"),               # 150 choices over the cap of 128
    ({"prompt": "Hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),            # over --max-logprobs (20)
    ({"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "Hi", "top_k": -5}, "top_k"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),   # pydantic validation
    ({"max_tokens": 3}, "prompt"),                             # missing field
    ({"prompt": "Hi", "stream": True, "top_p": 2}, "top_p"),   # streamed: still a plain 400
]


@pytest.mark.parametrize("body,param", COMPLETION_400)
def test_completion_bad_params_400(http, body, param):
    _assert_error(http.post("/v1/completions", json=body), 400, param)


def test_prompt_plus_max_tokens_over_max_model_len(http, engine):
    n = len(engine.tokenizer.encode("Hello there"))
    err = _assert_error(http.post("/v1/completions",
                                  json={"prompt": "Hello there", "max_tokens": MAX_LEN}),
                        400, "max_tokens")
    assert str(MAX_LEN) in err["message"] and str(n) in err["message"]
    assert str(n + MAX_LEN) in err["message"]


CHAT_400 = [
    ({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_LEN * 2}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "Hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
     "logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({}, "messages"),
]


@pytest.mark.parametrize("body,param", CHAT_400)
def test_chat_bad_params_400(http, body, param):
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_400(http, path):
    r = http.post(path, content=b'{"prompt": "Hi", ', headers={"content-type": "application/json"})
    err = _assert_error(r, 400)
    assert "JSON" in err["message"] or "json" in err["message"]


def test_missing_chat_template_400(http, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer.hf, "chat_template", None)
    err = _assert_error(http.post("/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "Hi"}]}),
                        400, "messages")
    assert "chat template" in err["message"]


def test_unknown_model_404(http, client, live_server):
    r = http.post("/v1/completions", json={"model": "gpt-17", "prompt": "Hi"})
    err = _assert_error(r, 404, "model", types=("NotFoundError",))
    assert "gpt-17" in err["message"]
    # names the served model, so the client can fix its request
    assert err["message"] == f"The model `gpt-17` does not exist. Served: {live_server.model}"
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "x"})]:
        err = _assert_error(http.post(path, json=dict(body, model="gpt-17")), 404, "model",
                            types=("NotFoundError",))
        assert err["message"].endswith(f"Served: {live_server.model}"), err
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("method,path,status,message", [
    ("GET", "/nope", 404, "Not Found: GET /nope"),
    ("POST", "/v1/nope", 404, "Not Found: POST /v1/nope"),
    ("GET", "/v1/completions", 405, "Method Not Allowed: GET /v1/completions (allowed: POST)"),
    ("DELETE", "/v1/models", 405, "Method Not Allowed: DELETE /v1/models (allowed: GET)"),
])
def test_unknown_route_and_method_answer_the_error_shape(http, method, path, status, message):
    """No route / no such method on a route: OpenAI's error body (not FastAPI's {"detail"}),
    naming what was asked; the server keeps serving."""
    r = http.request(method, path, json={"prompt": "Hi"})
    err = _assert_error(r, status, None, types=("NotFoundError" if status == 404
                                                else "MethodNotAllowedError",))
    assert r.json() == {"error": {"message": message, "type": err["type"], "param": None,
                                  "code": status}}
    assert http.get("/health").status_code == 200


def test_openai_client_sees_bad_request(client, live_server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=live_server.model, prompt="Hi", max_tokens=MAX_LEN + 1)
    assert ei.value.status_code == 400
    assert str(MAX_LEN) in str(ei.value)


def test_engine_survives_errors(http, client, live_server, engine, helpers):
    """Runs after the error tests above (file order): the core is alive and serves requests.
    (Engine-step failures are injected in test_core_process.py, on a server of their own.)"""
    assert http.get("/health").status_code == 200
    resp = client.completions.create(model=live_server.model, prompt="Hi", max_tokens=2)
    assert resp.usage.completion_tokens >= 1
    helpers.wait_all_blocks_free(engine)


# ------------------------------------------------------------------------------- disconnects
# 1,500 tokens take >= 15 s to finish by themselves (float32, ~10 ms a token on a quiet host), so
# a disconnect must abort the request: the tests check its blocks come free and that it finished
# as ``abort`` (not ``length``: LONG would run to its 1,500 tokens otherwise)
LONG = {"prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 1500, "temperature": 0,
        "ignore_eos": True}
ABORT_WITHIN_S = 120.0  # a hang guard, not a speed bound: a loaded host must not fail it


def finished(base_url: str) -> dict[str, float]:
    """``vllm:request_success_total`` by finished_reason, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def assert_aborted_once(before: dict[str, float], after: dict[str, float]) -> None:
    assert after.get("abort", 0) == before.get("abort", 0) + 1, (before, after)
    assert after.get("length", 0) == before.get("length", 0), (before, after)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_blocks(live_server, engine, helpers, path):
    body = dict(LONG, stream=True)
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    before = finished(live_server.base_url)
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        # read before leaving the loop: the loop's end closes the line iterator,
                        # and with it httpcore's stream and the connection (the abort may free
                        # the blocks before a read after the loop)
                        s = engine.stats  # it holds blocks while running
                        break
            assert s.num_free_blocks < s.num_blocks
    # leaving both `with` blocks closed the connection
    helpers.wait_all_blocks_free(engine, timeout=ABORT_WITHIN_S)
    assert_aborted_once(before, finished(live_server.base_url))
    assert http_ok(live_server)


def http_ok(live_server) -> bool:
    return httpx.get(live_server.base_url + "/health").status_code == 200


def test_disconnect_nonstream_running_frees_blocks(live_server, engine, helpers):
    before = finished(live_server.base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/completions", json=LONG, timeout=1.5)
    helpers.wait_all_blocks_free(engine, timeout=ABORT_WITHIN_S)
    assert_aborted_once(before, finished(live_server.base_url))
    assert http_ok(live_server)


@pytest.fixture(scope="module")
def one_seq_server(helpers):
    """A second server that runs one request at a time, so a second one must queue."""
    srv = helpers.start_server(EngineConfig(model=None, dtype="float32", num_kv_blocks=64,
                                            max_model_len=512, max_num_seqs=1))
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_queued_frees_blocks(one_seq_server, helpers, stream):
    srv = one_seq_server
    stats = lambda: srv.engine.stats  # noqa: E731 - the core's latest snapshot
    victim_body = {"prompt": "Hello", "max_tokens": 8, "stream": stream}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        # max_model_len 512 here: 400 tokens (~4 s), so this test's last wait stays at 1 s
        with c.stream("POST", "/v1/completions", json=dict(LONG, max_tokens=400,
                                                            stream=True)) as long_r:
            # keep the line iterator referenced: dropping it would close the connection
            lines = long_r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert stats().num_running == 1, first  # the long request is running

            def victim():
                try:
                    if stream:
                        with httpx.stream("POST", srv.base_url + "/v1/completions",
                                          json=victim_body, timeout=1.5) as vr:
                            for _ in vr.iter_lines():
                                pass
                    else:
                        httpx.post(srv.base_url + "/v1/completions", json=victim_body,
                                   timeout=1.5)
                except httpx.TimeoutException:
                    pass

            t = threading.Thread(target=victim)
            t.start()
            deadline = time.monotonic() + 60  # a hang guard, not a speed bound
            while stats().num_waiting != 1:  # the victim is queued
                assert time.monotonic() < deadline, "victim never queued"
                time.sleep(0.01)
            t.join(timeout=60)  # the client gave up (timeout) and closed its connection
            assert not t.is_alive()
            while stats().num_waiting:  # until it leaves the queue
                assert time.monotonic() < deadline + 60, "queued request was not aborted"
                time.sleep(0.01)
            # it left the queue aborted, not admitted: the long one still runs (its stream goes
            # on), so the one running request is the long one
            assert stats().num_running == 1
            assert next(ln for ln in lines if ln.startswith("data: ")) != "data: [DONE]"
    helpers.wait_all_blocks_free(srv.engine, timeout=60)
    assert http_ok(srv)
