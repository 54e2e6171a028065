"""Disaggregated serving: each request runs in two halves, its prompt on a prefill server and
its output on a decode server, joined by ``kv_transfer_params`` (vLLM's field). Every server
describes its KV transfer endpoint at ``GET /kv_transfer``: ``{"kv_role", "engine_id",
"kv_host", "kv_port", "mode": "pull" | "push"}``. Two flows (``--kv-transfer-flow``):

serial (vLLM's disaggregated proxy)
    1. to a prefill server: the client's body with ``max_tokens`` 1 (and
       ``max_completion_tokens`` 1 for a chat), ``stream`` false, ``n`` 1, no
       ``stream_options``, and ``"kv_transfer_params": {"do_remote_decode": true}``;
    2. if its answer is not a 200, the client gets it; if its first token finished the
       request (``finish_reason`` "stop") or the client asked for one token, the client gets
       that answer (as an SSE stream when it asked for one);
    3. else to a decode server: the client's body with the prefill answer's top-level
       ``kv_transfer_params``; its answer (with the first token: one normal response) goes to
       the client, streamed or not as asked.

concurrent (SGLang's bootstrap: the decode server can take the KV layer by layer)
    a fresh ``transfer_id`` T; both halves at once: the prefill server gets the body of step 1
    with ``{"do_remote_decode": true, "transfer_id": T}`` (in push mode also ``remote_host`` /
    ``remote_port``: the decode server's KV endpoint), the decode server the client's body with
    ``{"do_remote_prefill": true, "transfer_id": T}`` (in pull mode also the prefill server's
    KV endpoint). The client gets the decode server's answer. If the prefill half fails (no
    connection, a non-200, a broken connection) the decode half is aborted (its connection
    closed) and the client gets the prefill server's error (an error event if the stream had
    begun). A KV endpoint host that is a wildcard (``0.0.0.0``) becomes the server URL's host.

The prefill server is chosen by ``--routing-policy`` (prefix-aware on the prefill servers' KV
events when configured), the decode server by least-outstanding.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from urllib.parse import urlsplit

from fastapi.responses import Response

from sloserve.router.errors import DONE, RouterError
from sloserve.router.policies import RouteContext
from sloserve.router.proxy import Proxy, dumps
from sloserve.router.upstream import Upstream
from sloserve.router.workers import Worker

_WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::", "[::]")


def prefill_body(body: dict, chat: bool, kv: dict) -> dict:
    """The prefill half's body: one token, not streamed, one choice, ``kv_transfer_params``."""
    b = dict(body)
    b["max_tokens"] = 1
    if chat:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b["n"] = 1
    if isinstance(b.get("min_tokens"), int) and b["min_tokens"] > 1:
        b["min_tokens"] = 1
    b["kv_transfer_params"] = kv
    return b


def client_max_tokens(body: dict, chat: bool):
    if chat and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens")


def _include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    return isinstance(so, dict) and bool(so.get("include_usage"))


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=True).encode() + b"\n\n"


def json_to_sse(obj: dict, chat: bool, include_usage: bool) -> bytes:
    """A whole (non-streamed) completion as the stream a client that asked for one expects:
    one chunk per choice with all its text and its finish reason, the usage chunk if asked
    for, ``[DONE]``."""
    head = {"id": obj.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": obj.get("created"), "model": obj.get("model")}
    out = []
    for c in obj.get("choices") or []:
        if chat:
            msg = c.get("message") or {}
            choice = {"index": c.get("index", 0),
                      "delta": {"role": msg.get("role", "assistant"),
                                "content": msg.get("content")},
                      "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
        else:
            choice = {"index": c.get("index", 0), "text": c.get("text", ""),
                      "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
        out.append(_sse({**head, "choices": [choice]}))
    if include_usage and obj.get("usage") is not None:
        out.append(_sse({**head, "choices": [], "usage": obj["usage"]}))
    return b"".join(out) + DONE


def kv_endpoint(w: Worker, info: dict) -> tuple[str, int]:
    """The (host, port) of a server's KV transfer endpoint, a wildcard host made its URL's."""
    host = info.get("kv_host")
    if not isinstance(host, str) or host in _WILDCARD_HOSTS:
        host = urlsplit(w.url).hostname
    return host, info.get("kv_port")


class Disaggregated:
    """The two flows over ``proxy``'s prefill and decode servers.

    Args:
        proxy: the router's forwarding.
        prefill_policy, decode_policy: how each half's server is chosen.
        flow: ``concurrent`` or ``serial``.
        tokenizer: for a prefix-aware prefill policy.
    """

    def __init__(self, proxy: Proxy, prefill_policy, decode_policy, flow: str, tokenizer=None):
        self.proxy = proxy
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.flow = flow
        self.tokenizer = tokenizer

    async def handle(self, body: dict, path: str, chat: bool, headers: dict) -> Response:
        try:
            if self.flow == "serial":
                return await self.serial(body, path, chat, headers)
            return await self.concurrent(body, path, chat, headers)
        except RouterError as e:
            return e.response(path)

    # ------------------------------------------------------------------ serial
    async def serial(self, body: dict, path: str, chat: bool, headers: dict) -> Response:
        px = self.proxy
        stream = bool(body.get("stream"))
        ctx = RouteContext(body, chat, self.tokenizer)
        await px.choose("decode", self.decode_policy, ctx)  # 503 now if none could decode it
        pu = await px.open("prefill", self.prefill_policy, ctx, path,
                           dumps(prefill_body(body, chat, {"do_remote_decode": True})), headers)
        try:
            content = await pu.read()
        finally:
            await pu.close()
        ctype = pu.response_headers.get("content-type", "application/json")
        if pu.status != 200:
            return Response(content, status_code=pu.status, media_type=ctype)
        try:
            answer = json.loads(content)
            choice = (answer.get("choices") or [{}])[0]
        except (ValueError, AttributeError, TypeError):
            raise RouterError(502, f"prefill server {pu.worker.url} answered no completion "
                                   f"JSON", "bad_response") from None
        min_tokens = body.get("min_tokens")
        first_is_last = choice.get("finish_reason") == "stop" and not (
            isinstance(min_tokens, int) and min_tokens > 1)
        if first_is_last or client_max_tokens(body, chat) == 1:
            if stream:
                return Response(json_to_sse(answer, chat, _include_usage(body)),
                                media_type="text/event-stream")
            return Response(content, status_code=200, media_type=ctype)
        kv = answer.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise RouterError(502, f"prefill server {pu.worker.url} returned no "
                                   f"kv_transfer_params", "bad_response")
        du = await px.open("decode", self.decode_policy, ctx, path,
                           dumps({**body, "kv_transfer_params": kv}), headers)
        return await px.respond(du, stream)

    # ------------------------------------------------------------------ concurrent
    async def _kv_info(self, w: Worker) -> dict:
        info = w.kv_info or await self.proxy.pool.fetch_kv_info(w)
        if not info or not isinstance(info.get("mode"), str):
            raise RouterError(503, f"{w.role} server {w.url} does not describe its KV "
                                   f"transfer (GET /kv_transfer)", "bad_response")
        return info

    async def concurrent(self, body: dict, path: str, chat: bool, headers: dict) -> Response:
        px = self.proxy
        stream = bool(body.get("stream"))
        ctx = RouteContext(body, chat, self.tokenizer)
        p = await px.choose("prefill", self.prefill_policy, ctx)
        d = await px.choose("decode", self.decode_policy, ctx)
        pinfo, dinfo = await self._kv_info(p), await self._kv_info(d)
        mode = pinfo["mode"]
        if mode not in ("pull", "push") or dinfo.get("mode") != mode:
            raise RouterError(503, f"KV transfer modes do not match: prefill {p.url} "
                                   f"{pinfo.get('mode')!r}, decode {d.url} "
                                   f"{dinfo.get('mode')!r}", "bad_response")
        tid = uuid.uuid4().hex
        pkv = {"do_remote_decode": True, "transfer_id": tid}
        dkv = {"do_remote_prefill": True, "transfer_id": tid}
        if mode == "push":
            pkv["remote_host"], pkv["remote_port"] = kv_endpoint(d, dinfo)
        else:
            dkv["remote_host"], dkv["remote_port"] = kv_endpoint(p, pinfo)
        pu = px.start(p, path, dumps(prefill_body(body, chat, pkv)), headers)
        du = px.start(d, path, dumps({**body, "kv_transfer_params": dkv}), headers)
        watcher = asyncio.create_task(_watch_prefill(pu, du), name=f"prefill {tid}")

        async def close_prefill() -> None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await pu.close()

        try:
            await du.head()
        except RouterError as e:
            await du.close()
            await close_prefill()
            return e.response()
        except BaseException:
            await du.close()
            await close_prefill()
            raise
        return await px.respond(du, stream, also_close=[close_prefill])


async def _watch_prefill(pu: Upstream, du: Upstream) -> None:
    """Fail the decode half with the prefill half's error, if it fails."""
    try:
        status = await pu.head()
        content = await pu.read()
    except RouterError as e:
        du.fail(RouterError(e.status, f"prefill server {pu.worker.url} failed: {e.message}",
                            "prefill_failed", body=e.body, content_type=e.content_type))
        return
    if status != 200:
        du.fail(RouterError(status, f"prefill server {pu.worker.url} answered {status}",
                            "prefill_failed", body=content,
                            content_type=pu.response_headers.get("content-type")))

