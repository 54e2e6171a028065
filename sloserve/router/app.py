"""The router's OpenAI front (FastAPI):

    POST /v1/completions, /v1/chat/completions   proxied to a worker (streamed or not); with
                                                 --prefill/--decode, in two halves (disagg)
    POST /v1/messages, /v1/messages/count_tokens,
         /v1/responses                           proxied whole to a replica (with --prefill/
                                                 --decode: to a decode server, not split); a
                                                 Responses turn with previous_response_id
                                                 goes to the worker that stored that response
    GET  /v1/responses/{id}                      the stored response, from the worker that has
                                                 it (404 when none has)
    GET  /v1/models                              a healthy worker's answer
    GET  /health                                 200 while at least one worker of each role it
                                                 needs is healthy, else 503; JSON either way:
                                                 {"status", "policy", "workers": [...]}
    GET  /metrics                                Prometheus text (``metrics``)
    GET  /stats, /stats/stream                   a server's ``/stats`` shape: the router's own
                                                 figures and window (the requests it timed,
                                                 ``timing``), the workers' figures summed
                                                 (``sloserve.stats.merge_values``) and each
                                                 worker's window; as SSE (``?interval=``)
    GET  /dashboard                              the servers' live page over /stats/stream

Errors are in the API's own shape (OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, Anthropic's on ``/v1/messages``): 400 for a body that is not a JSON object, 502 when
a worker failed the request, 503 when no worker can take it; a worker's own errors pass through
as it gave them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.body_limit import BodyLimitMiddleware
from sloserve.error_shapes import validation_message
from sloserve.stats import DASHBOARD_HTML, merge_values
from sloserve.router.config import RouterConfig
from sloserve.router.disagg import Disaggregated
from sloserve.router.errors import RouterError, error_response
from sloserve.router.kv_subscriber import KVEventSubscriber
from sloserve.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from sloserve.router.policies import LeastOutstanding, Pinned, RouteContext, make_policy
from sloserve.router.prefix_index import PrefixIndex
from sloserve.router.prompt import PromptTokenizer
from sloserve.router.proxy import Proxy, forward_headers
from sloserve.router.timing import RequestTimer
from sloserve.router.workers import Worker, WorkerPool

logger = logging.getLogger("sloserve.router")

#: how long one round of the workers' /stats answers serves every /stats client (s)
STATS_TTL_S = 0.5


class Router:
    """Everything the app serves from: the workers and their health polls, the KV event
    subscriptions, the policies and the forwarding.

    Args:
        config: the settings (validated here).
        transport: an httpx transport for every request to the workers (tests).
    """

    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None):
        cfg = self.config = config.validate()
        self.metrics = RouterMetrics(cfg.goodput)
        if cfg.disaggregated:
            workers = ([Worker(u, "prefill", i) for i, u in enumerate(cfg.prefill)]
                       + [Worker(u, "decode", i) for i, u in enumerate(cfg.decode)])
            self.roles = ("prefill", "decode")
        else:
            workers = [Worker(u, "replica", i) for i, u in enumerate(cfg.replicas)]
            self.roles = ("replica",)
        self.routed_role = self.roles[0]
        timeout = httpx.Timeout(connect=cfg.connect_timeout, read=None, write=60.0, pool=None)
        self.client = httpx.AsyncClient(
            transport=transport, timeout=timeout, trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.health_client = httpx.AsyncClient(transport=transport, trust_env=False,
                                               timeout=cfg.health_check_timeout)
        self.index = PrefixIndex(cfg.speculative_ttl) if cfg.events_wanted else None
        self.pool = WorkerPool(
            workers, self.health_client, cfg.health_check_interval, cfg.health_check_timeout,
            want_kv_info=cfg.disaggregated and cfg.kv_transfer_flow == "concurrent",
            on_down=self._on_down)
        self.tokenizer = (PromptTokenizer(self.client, cfg.tokenizer)
                          if cfg.policy == "prefix-aware" else None)
        self.policy = make_policy(cfg.policy, self.index, cfg, self.metrics)
        self.proxy = Proxy(self.pool, self.client, self.metrics)
        self.disagg = (Disaggregated(self.proxy, self.policy, LeastOutstanding(self.metrics),
                                     cfg.kv_transfer_flow, self.tokenizer)
                       if cfg.disaggregated else None)
        self._zmq_ctx = None
        self.subscribers: list[KVEventSubscriber] = []
        #: the workers' /stats, shared by every /stats client for STATS_TTL_S
        self._stats_lock = asyncio.Lock()
        self._stats_got: list | None = None
        self._stats_at = 0.0
        self._stats_last: dict[str, dict] = {}

    def _on_down(self, w: Worker) -> None:
        if self.index is not None:
            self.index.clear(w.url)

    async def start(self) -> None:
        if self.index is not None:
            import zmq.asyncio
            self._zmq_ctx = zmq.asyncio.Context()
            topic = self.config.kv_events_config.topic if self.config.kv_events_config else ""
            for url, (ep, replay) in zip(self.config.routed, self.config.events_endpoints()):
                s = KVEventSubscriber(self._zmq_ctx, url, ep, topic, replay, self.index)
                s.start()
                self.subscribers.append(s)
        await self.pool.start()
        logger.info("router: %s, policy %s%s", ", ".join(
            f"{len(self.pool.role(r))} {r}" for r in self.roles), self.config.policy,
            f", {self.config.kv_transfer_flow} KV transfer flow" if self.disagg else "")

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.subscribers))
        await self.pool.close()
        await self.client.aclose()
        await self.health_client.aclose()
        if self._zmq_ctx is not None:
            self._zmq_ctx.term()

    # ------------------------------------------------------------------ requests
    async def generate(self, request: Request, path: str, chat: bool,
                       whole: bool = False) -> Response:
        """Proxy a generation request. ``whole``: never split in two halves (the agent APIs,
        whose bodies the prefill/decode flow does not speak: a decode server serves them
        alone, as any server serves a request without ``kv_transfer_params``)."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error_response(400, f"the body is not JSON: {e}", path=path)
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", path=path)
        headers = forward_headers(request)
        if self.disagg is not None and not whole:
            timer = RequestTimer(self.metrics, chat, body)
            return timer.wrap(await self.disagg.handle(body, path, chat, headers))
        role = "decode" if self.disagg is not None else "replica"
        policy = self.disagg.decode_policy if self.disagg is not None else self.policy
        previous = body.get("previous_response_id") if path == "/v1/responses" else None
        if isinstance(previous, str) and previous:
            holder = await self._holder(role, previous)
            if holder is not None:
                policy = Pinned(holder[0], policy, self.metrics)
        ctx = RouteContext(body, chat, self.tokenizer)
        timer = None if whole else RequestTimer(self.metrics, chat, body)
        try:
            up = await self.proxy.open(role, policy, ctx, path, raw, headers)
        except RouterError as e:
            return e.response(path)
        resp = await self.proxy.respond(up, bool(body.get("stream")))
        return resp if timer is None else timer.wrap(resp)

    async def _holder(self, role: str, response_id: str) -> tuple[Worker, httpx.Response] | None:
        """The worker of ``role`` that stores response ``response_id`` (each server keeps its
        own, in memory), and its answer to ``GET /v1/responses/{id}``: all asked at once."""
        workers = self.pool.available(role)

        async def ask(w: Worker):
            try:
                r = await self.client.get(f"{w.url}/v1/responses/{quote(response_id, safe='')}",
                                          timeout=5.0)
            except httpx.HTTPError:
                return None
            return (w, r) if r.status_code == 200 else None
        for got in await asyncio.gather(*(ask(w) for w in workers)):
            if got is not None:
                return got
        return None

    async def stored_response(self, response_id: str) -> Response:
        role = "decode" if self.disagg is not None else "replica"
        got = await self._holder(role, response_id)
        if got is None:
            return error_response(404, f"no response with id {response_id!r} is stored on any "
                                       f"{'decode server' if role == 'decode' else 'replica'}",
                                  "response_id")
        return Response(got[1].content, status_code=200, media_type="application/json")

    async def models(self) -> Response:
        role = "decode" if self.disagg is not None else "replica"
        for w in self.pool.available(role) + self.pool.available("prefill"):
            try:
                r = await self.client.get(w.url + "/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return error_response(503, "no healthy worker to ask for its models")

    async def _worker_stats(self) -> list[dict | None]:
        """Each worker's ``/stats`` answer now (None: no answer), asked at most every
        ``STATS_TTL_S`` however many clients watch (they share one round of requests)."""
        async with self._stats_lock:
            now = time.monotonic()
            if self._stats_got is not None and now - self._stats_at < STATS_TTL_S:
                return self._stats_got

            async def ask(w: Worker) -> dict | None:
                try:
                    r = await self.health_client.get(w.url + "/stats")
                    d = r.json() if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    return None
                ok = isinstance(d, dict) and isinstance(d.get("cumulative"), dict)
                if ok:
                    self._stats_last[w.url] = d
                return d if ok else None
            self._stats_got = await asyncio.gather(*(ask(w) for w in self.pool.workers))
            self._stats_at = time.monotonic()
            return self._stats_got

    async def stats(self) -> dict:
        """``GET /stats``: the router's snapshot, the workers' values summed under it (the
        router's own keys kept; a worker that did not answer counts with its last answer, so
        totals do not fall), each worker's window (None when it did not answer)."""
        snap = self.metrics.snapshot(self.pool.workers)
        got = await self._worker_stats()
        last = [self._stats_last.get(w.url) for w in self.pool.workers]
        for k, v in merge_values([g["cumulative"] for g in last if g]).items():
            snap["cumulative"].setdefault(k, v)
        snap["model"] = next((g.get("model") for g in last if g), None)
        snap["workers"] = [{"url": w.url, "role": w.role, "state": w.state,
                            "seq": g.get("seq") if g else None,
                            "window": g.get("window") if g else None}
                           for w, g in zip(self.pool.workers, got)]
        return snap

    def health(self) -> tuple[bool, dict]:
        ready = all(self.pool.available(r) for r in self.roles)
        workers = []
        for w in self.pool.workers:
            d = w.describe()
            if self.index is not None and w.role == self.routed_role:
                d["cached_blocks"] = self.index.num_blocks(w.url)
            workers.append(d)
        return ready, {"status": "ok" if ready else "unavailable",
                       "policy": self.config.policy, "workers": workers}


def build_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router's app; its lifespan starts and stops the :class:`Router` (``app.state.router``)."""
    router = Router(config, transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="sloserve router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(exc)
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.generate(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await router.generate(request, "/v1/messages", chat=False, whole=True)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await router.generate(request, "/v1/messages/count_tokens", chat=False,
                                     whole=True)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await router.generate(request, "/v1/responses", chat=False, whole=True)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        return await router.stored_response(response_id)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    @app.head("/health", operation_id="health_head")
    async def health() -> Response:
        ready, body = router.health()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(router.pool.workers),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> Response:
        return JSONResponse(await router.stats())

    @app.get("/stats/stream")
    async def stats_stream(raw: Request, interval: float = Query(1.0, ge=0.1, le=60.0),
                           steps: bool = False) -> Response:
        """``/stats`` as server-sent events every ``interval`` s until the client goes
        (``steps``: accepted for the page's sake; the router runs no steps)."""
        async def events():
            while not await raw.is_disconnected():
                yield b"data: " + json.dumps(await router.stats()).encode() + b"\n\n"
                await asyncio.sleep(interval)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(DASHBOARD_HTML, media_type="text/html; charset=utf-8")

    return app
