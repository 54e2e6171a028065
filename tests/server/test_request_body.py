"""Request bodies: over ``--max-request-body-bytes`` -> 413, a JSON body that is not UTF-8 ->
400, both with OpenAI's error body and the connection kept for the next request."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from sloserve.server.app import build_app
from sloserve.body_limit import DEFAULT_MAX_BODY_BYTES
from sloserve.server.metrics import PrometheusStatLogger
from sloserve.server.utf8_body import Utf8BodyMiddleware

LIMIT = DEFAULT_MAX_BODY_BYTES
JSON = {"content-type": "application/json"}


def _too_large(size: int, limit: int = LIMIT) -> dict:
    return {"error": {"message": f"request body of {size} bytes is over the limit of {limit} "
                                 f"bytes (--max-request-body-bytes)",
                      "type": "RequestTooLargeError", "param": None, "code": 413}}


def _not_utf8(byte: int, at: int, reason: str) -> dict:
    return {"error": {"message": f"request body is not valid UTF-8: byte 0x{byte:02x} at offset "
                                 f"{at} ({reason}); JSON must be sent as UTF-8",
                      "type": "BadRequestError", "param": None, "code": 400}}


def _local_addr(r: httpx.Response):
    return r.extensions["network_stream"].get_extra_info("client_addr")


def test_one_connection_serves_stream_whole_413s_400_and_more(live_server):
    """Everything in order over one keep-alive connection: a refused body (even one the server
    never read) leaves the connection usable."""
    big = b'{"prompt": "' + b"a" * (LIMIT - 13) + b'"}'  # LIMIT + 1 bytes
    assert len(big) == LIMIT + 1

    def chunks():  # no Content-Length: refused as it passes the limit
        for _ in range(11):
            yield b"a" * 2 ** 20

    addrs = []
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={
                "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            addrs.append(_local_addr(r))
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True})
        addrs.append(_local_addr(r))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

        r = c.post("/v1/completions", content=big, headers=JSON)
        addrs.append(_local_addr(r))
        assert (r.status_code, r.json()) == (413, _too_large(LIMIT + 1))

        r = c.post("/v1/completions", content=chunks(), headers=JSON)
        addrs.append(_local_addr(r))
        assert r.status_code == 413
        msg = r.json()["error"]["message"]
        seen = int(msg.split()[3])
        assert LIMIT < seen <= 11 * 2 ** 20 and r.json() == _too_large(seen)

        r = c.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", '
                                                     b'"content": "caf\xe9"}]}', headers=JSON)
        addrs.append(_local_addr(r))
        assert (r.status_code, r.json()) == (400, _not_utf8(0xE9, 46, "invalid continuation byte"))

        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 3, "temperature": 0})
        addrs.append(_local_addr(r))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert len(addrs) == 6 and len(set(addrs)) == 1, addrs  # one connection throughout


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before a response"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:]))
    n = int(headers.get("content-length", 0))
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


def test_a_content_length_over_the_limit_is_answered_before_the_body_is_sent(live_server):
    """The 413 comes back while the client has sent the headers alone; the body sent after it
    is discarded and the same connection answers the next request."""
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1))
        status, headers, body = _read_response(s)  # a server waiting for the body: timeout
        assert status == 413 and headers["content-type"] == "application/json"
        assert json.loads(body) == _too_large(LIMIT + 1)
        s.sendall(b"a" * (LIMIT + 1))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[0] == 200


@pytest.mark.parametrize("body,byte,at,reason", [
    (b'{"prompt": "\xff\xfe"}', 0xFF, 12, "invalid start byte"),
    ('{"prompt": "café"}'.encode("latin-1"), 0xE9, 15, "invalid continuation byte"),
    ('{"prompt": "hi"}'.encode("utf-16"), 0xFF, 0, "invalid start byte"),  # json.loads took it
    (b'{"prompt": "\xed\xa0\x80"}', 0xED, 12, "invalid continuation byte"),  # CESU-8 surrogate
    (b'{"prompt": "caf\xc3', 0xC3, 15, "unexpected end of data"),
], ids=["ff-fe", "latin-1", "utf-16", "cesu-8-surrogate", "cut-inside-a-character"])
def test_a_json_body_that_is_not_utf8_is_400(live_server, body, byte, at, reason):
    r = httpx.post(live_server.base_url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert (r.status_code, r.json()) == (400, _not_utf8(byte, at, reason))


def test_utf8_with_a_bom_or_split_across_chunks_is_served(live_server):
    base = live_server.base_url + "/v1/completions"
    r = httpx.post(base, content=b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}', headers=JSON,
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1

    def split():  # "é" = c3 a9 across two chunks
        yield b'{"prompt": "caf\xc3'
        time.sleep(0.05)
        yield b'\xa9", "max_tokens": 1}'
    r = httpx.post(base, content=split(), headers=JSON, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] >= 2


def _run_middleware(messages: list[dict], content_type: bytes = b"application/json") -> list:
    """Feed ``messages`` through Utf8BodyMiddleware to an app that receives them all."""
    got: list = []

    async def app(scope, receive, send):
        while True:
            msg = await receive()
            got.append(msg)
            if not msg.get("more_body"):
                return

    async def receive():
        return messages.pop(0)

    scope = {"type": "http", "headers": [(b"content-type", content_type)]}
    asyncio.run(Utf8BodyMiddleware(app)(scope, receive, None))
    return got


def test_the_utf8_check_counts_offsets_across_messages():
    from starlette.exceptions import HTTPException

    ok = [{"type": "http.request", "body": b'{"a": "caf\xc3', "more_body": True},
          {"type": "http.request", "body": b'\xa9"}', "more_body": False}]
    assert len(_run_middleware(list(ok))) == 2
    for second, at, reason in ((b'"}', 10, "invalid continuation byte"),
                               (b'\xa9\xff"}', 12, "invalid start byte")):
        bad = [{"type": "http.request", "body": b'{"a": "caf\xc3', "more_body": True},
               {"type": "http.request", "body": second, "more_body": False}]
        with pytest.raises(HTTPException) as e:
            _run_middleware(bad)
        assert e.value.status_code == 400
        byte = 0xC3 if at == 10 else 0xFF
        assert e.value.detail == _not_utf8(byte, at, reason)["error"]["message"]
    cut = [{"type": "http.request", "body": b'{"a": "\xc3', "more_body": False}]
    with pytest.raises(HTTPException, match=r"byte 0xc3 at offset 7 \(unexpected end of data\)"):
        _run_middleware(cut)
    # not JSON: not this middleware's business
    assert len(_run_middleware([{"type": "http.request", "body": b"\xff"}], b"text/plain")) == 1


def _stub_app(limit: int):
    """The real app over an engine stub: the refusals happen before any route touches it."""
    engine = SimpleNamespace(model_name="m", max_model_len=64, tokenizer=None,
                             info=SimpleNamespace(max_num_batched_tokens=64))
    return build_app(engine, PrometheusStatLogger(), max_request_body_bytes=limit)


def _asgi_post(app, chunks: list[bytes], content_length: bool = True,
               path: str = "/v1/completions") -> tuple[int, dict]:
    """POST ``chunks`` (one ASGI message each) to ``app`` at ``path``; its status and JSON
    body."""
    headers = [(b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_the_limit_is_the_apps_setting():
    app = _stub_app(64)
    assert _asgi_post(app, [b"{" + b" " * 64]) == (413, _too_large(65, 64))
    status, body = _asgi_post(app, [b"{" + b" " * 63])  # at the limit: parsed (and malformed)
    assert status == 400 and body["error"]["message"].startswith("malformed JSON")
    # chunked: refused in the message that passes the limit (4 x 20 bytes)
    assert _asgi_post(app, [b" " * 20] * 5, content_length=False) == (413, _too_large(80, 64))
    # under the limit but not UTF-8: the UTF-8 check runs after the size check
    assert _asgi_post(app, [b'{"prompt": "\xff"}'])[0] == 400
    assert _asgi_post(app, [b'{"prompt": "\xff"}' + b" " * 60])[0] == 413


def test_anthropics_routes_get_its_error_shape_for_both_refusals():
    app = _stub_app(64)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert _asgi_post(app, [b"{" + b" " * 64], path=path) == (413, {
            "type": "error", "error": {"type": "request_too_large", "message": _too_large(
                65, 64)["error"]["message"]}})
        assert _asgi_post(app, [b'{"model": "m", "\xff": 1}'], path=path) == (400, {
            "type": "error", "error": {"type": "invalid_request_error", "message": _not_utf8(
                0xFF, 16, "invalid start byte")["error"]["message"]}})


def test_the_flag_is_checked_and_documented():
    cli = [sys.executable, "-m", "sloserve.cli", "serve"]
    p = subprocess.run([*cli, "--max-request-body-bytes", "0"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "sloserve serve: error: argument --max-request-body-bytes: expected an integer >= 1, "
        "got 0")
    help_text = " ".join(subprocess.run([*cli, "--help"], capture_output=True, text=True,
                                        timeout=60).stdout.split())
    assert (f"--max-request-body-bytes N larger request bodies get HTTP 413 in the API's "
            f"error shape (default {DEFAULT_MAX_BODY_BYTES} = 10 MiB)") in help_text


def test_the_cli_default_is_the_servers_without_importing_the_server():
    """One default: the CLI's --max-request-body-bytes is the server's DEFAULT_MAX_BODY_BYTES,
    taken from sloserve.config, so parsing the flags imports no server code."""
    code = ("import sys, sloserve.cli as c; from sloserve.config import DEFAULT_MAX_BODY_BYTES as D; "
            "seen = []; c._serve = lambda a: seen.append(a.max_request_body_bytes) or 0; "
            "assert c.main(['serve']) == 0 and seen == [D], seen; "
            "assert not [m for m in sys.modules if m.startswith('sloserve.server')]")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert DEFAULT_MAX_BODY_BYTES == 10 * 2 ** 20
