"""A server that streams something other than OpenAI chunks fails that request, never the run."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from sloserve.bench.request_func import RequestInput, send_request

GOOD = 'data: {"choices": [{"text": "hi"}]}\n\n'


def run(body: str, chat: bool = False):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            inp = RequestInput(url="http://mock/v1/completions", model="m", prompt="p",
                               prompt_len=1, max_tokens=4, chat=chat)
            return await send_request(client, inp)
    return asyncio.run(go())


@pytest.mark.parametrize("event, what", [
    ("[1, 2]", "not a JSON object"),
    ("{not json", "not JSON"),
    ('{"usage": 5}', "usage must be an object"),
    ('{"usage": {"completion_tokens": "x"}}', "usage.completion_tokens"),
    ('{"usage": {"completion_tokens": -1}}', "usage.completion_tokens"),
    ('{"choices": [null]}', "choices must be a list of objects"),
    ('{"choices": [{"text": 5}]}', "chunk text must be a string"),
])
def test_malformed_event_fails_the_request_with_its_reason(event, what):
    rec = run(GOOD + f"data: {event}\n\n" + "data: [DONE]\n\n")
    assert not rec.success
    assert rec.error.startswith("malformed stream event: ") and what in rec.error


def test_null_error_field_is_not_an_error():
    rec = run('data: {"choices": [{"text": "hi"}], "error": null}\n\n'
              'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 3}}\n\n'
              "data: [DONE]\n\n")
    assert rec.success and rec.output_tokens == 1 and rec.prompt_len == 3


def test_chat_delta_that_is_not_an_object_has_no_content():
    rec = run('data: {"choices": [{"delta": "x"}]}\n\n'
              'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n' "data: [DONE]\n\n", chat=True)
    assert rec.success and rec.generated_text == "ok" and len(rec.chunk_times) == 1
