"""Request bodies: a JSON body that is not UTF-8 -> 400 with OpenAI's error body."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from sloserve.server.utf8_body import Utf8BodyMiddleware

JSON = {"content-type": "application/json"}


def _not_utf8(byte: int, at: int, reason: str) -> dict:
    return {"error": {"message": f"request body is not valid UTF-8: byte 0x{byte:02x} at offset "
                                 f"{at} ({reason}); JSON must be sent as UTF-8",
                      "type": "BadRequestError", "param": None, "code": 400}}


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
