"""The HTTP routes.

    POST /v1/completions        text completion (streamed as SSE with ``"stream": true``)
    POST /v1/chat/completions   chat completion through the model's chat template (tool calling
                                and reasoning: ``sloserve.server.tools``)
    POST /v1/messages, /v1/messages/count_tokens   Anthropic's Messages API over the chat path
                                (``sloserve.server.messages_api``; errors in its shape)
    POST /v1/responses, GET /v1/responses/{id}     OpenAI's Responses API over the chat path
                                (``sloserve.server.responses_api``)
    GET  /v1/models             the served model
    GET  /health                200 while the engine core runs; 503 when it is down or
                                stalled (--engine-stall-timeout) or the server drains
    GET  /metrics               Prometheus text format (from the core's published snapshot)
    GET  /stats, /stats/stream  the same values as one JSON snapshot with a sequence number and
                                the last minute's latency percentiles (``sloserve.stats``); as SSE
    GET  /dashboard             a live HTML page over /stats/stream (``templates/dashboard.html``)
    POST /reset_prefix_cache    forget every cached prefix block (vLLM's endpoint)
    POST /tokenize, /detokenize, GET /tokenizer_info   vLLM's tokenizer endpoints
                                (``sloserve.server.tokenization``)
    GET  /kv_transfer           where this server's KV connector listens (404 without one)

Both completion endpoints take vLLM's ``kv_transfer_params`` (prefill/decode disaggregation):
the object is typed and checked in ``protocol`` (keys, types, fields not served with it yet),
the engine's role in ``Processor`` (a connector, the half its role runs); all 400s.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from sloserve.engine.admission import Rejection
from sloserve.engine.async_llm import AsyncLLM, Reservation
from sloserve.sampling_params import ParamError, child_seed
from sloserve.server.errors import APIError, error_response
from sloserve.server.logprobs_format import LogprobsFormatter
from sloserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from sloserve.stats import DASHBOARD_HTML
from sloserve.server.protocol import (ChatCompletionRequest, CompletionRequest, KVTransferInfo,
                                      ModelCard, ModelList, now_s, random_id)
from sloserve.server.spec_check import SpecChecker
from sloserve.server.sse import SSEResponse, sse
from sloserve.server.serving import (ChatBuilder, Choice, CompletionBuilder, stream_response,
                                     whole_response)
from sloserve.server.tokenization import build_tokenization_router
from sloserve.server.messages_api import (CountTokensRequest, MessagesBuilder, MessagesRequest,
                                          to_chat_request)
from sloserve.server.responses_api import (ResponsesBuilder, ResponsesRequest, ResponseStore,
                                           input_messages, responses_error)
from sloserve.server.responses_api import to_chat_request as responses_chat_request
from sloserve.server.tools import (ChatConfig, ToolPlan, check_tool_messages, plan_tools,
                                   reasoning_parser_for)


#: text longer than this (characters) is tokenized off the event loop
OFFLOAD_CHARS = 20_000



def build_router(engine: AsyncLLM, metrics: PrometheusStatLogger, state,
                 chat: ChatConfig = ChatConfig()) -> APIRouter:
    """The routes over ``engine``; ``state.draining`` (set on SIGTERM) turns new generations
    and /health into 503; ``chat``: tool calling, reasoning and the chat template
    (``sloserve.server.tools``)."""
    r = APIRouter()
    model_name = engine.model_name
    spec_checker = state.spec_checker = SpecChecker()  # closed by the app's lifespan
    fmt = LogprobsFormatter(engine.tokenizer)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise APIError(404, f"The model `{requested}` does not exist. "
                                f"Served: {model_name}", "model")

    def check_admitting() -> None:
        if getattr(state, "draining", False):
            raise APIError(503, "the server is shutting down")
        if not engine.is_running:
            raise APIError(503, "engine is not running")

    def reserve(choices: list[Choice], raw: Request) -> Reservation:
        """Overload control: the client's compile slot when the choices need a grammar new to
        the server (``--max-pending-compiles-per-client``; the client is the peer address) and
        the choices' places in the queue, all of them or a 429 (nothing reserved). Nothing
        awaits between this and the response that takes the reservation (``serving``), so a
        burst is counted one request after the other."""
        client = raw.client.host if raw.client is not None else "unknown"
        res = engine.reserve([c.request for c in choices], client)
        if isinstance(res, Rejection):
            metrics.count_rejection()
            raise APIError(429, res.message, headers={"Retry-After": str(res.retry_after_s)})
        return res

    def make_choices_sync(prompts: list[str | list[int]], body, base_id: str) -> list[Choice]:
        """Validate and tokenize each prompt once; its ``n`` choices are copies with their own
        ids (``<id>-<prompt>-<choice>``; the id alone for a single choice), a shared parent id
        and, with a seed, seeds ``seed + i`` (n different but reproducible samples). Only the
        first choice asks for the prompt's logprobs: they are computed once per prompt and
        every choice answers with them (``serving.PromptLogprobsShare``); its siblings then
        start from its cached prompt blocks. ``kv_transfer_params`` go with the request (its
        only choice)."""
        try:
            body.unsupported()
            kv = body.kv_transfer()
            sp = body.to_sampling_params()
            if sp.structured_outputs is not None:
                try:
                    spec_checker.check(sp.structured_outputs)  # off this process's GIL
                except ValueError as e:
                    raise ParamError(str(e), _spec_param(body)) from None
            n = body.n or 1
            echo = bool(getattr(body, "echo", False))
            choices: list[Choice] = []
            for p, prompt in enumerate(prompts):
                single = len(prompts) == 1 and n == 1
                parent = None if n == 1 else f"{base_id}-{p}"
                req = engine.make_request(prompt, sp, base_id if single else f"{base_id}-{p}-0",
                                          priority=body.priority, cache_salt=body.cache_salt,
                                          parent_request_id=parent, kv_transfer_params=kv)
                echo_text = None
                if echo:  # token ids are decoded as the output is (vLLM: the request's
                    # skip_special_tokens), so the default echo shows no <|im_start|>
                    echo_text = prompt if isinstance(prompt, str) else (
                        engine.tokenizer.decode(req.prompt_token_ids,
                                                skip_special_tokens=sp.skip_special_tokens)
                        if engine.tokenizer is not None else "")
                choices.append(Choice(req, p, echo_text))
                for i in range(1, n):
                    csp = req.sampling_params
                    if csp.seed is not None:
                        csp = replace(csp, seed=child_seed(csp.seed, i))
                    if csp.prompt_logprobs is not None:  # choice 0 computes them for all
                        csp = replace(csp, prompt_logprobs=None)
                    choices.append(Choice(msgspec.structs.replace(
                        req, request_id=f"{base_id}-{p}-{i}", sampling_params=csp), p, echo_text))
            return choices
        except ParamError as e:
            param = e.param
            if param == "max_tokens" and isinstance(body, ChatCompletionRequest):
                param = body.max_tokens_param
            raise APIError(400, str(e), param) from e

    async def make_choices(prompts: list[str | list[int]], body, base_id: str) -> list[Choice]:
        """Validate and tokenize; long text prompts are tokenized in a worker thread, so the
        event loop keeps answering (/health, other streams) meanwhile."""
        if (sum(len(p) for p in prompts if isinstance(p, str)) > OFFLOAD_CHARS
                or body.structured_outputs is not None or body.response_format is not None):
            return await asyncio.to_thread(make_choices_sync, prompts, body, base_id)
        return make_choices_sync(prompts, body, base_id)

    @r.get("/health")
    @r.head("/health", operation_id="health_head", include_in_schema=True)
    async def health() -> Response:
        """200 while the engine core runs and the server admits requests; 503 while it drains,
        when the core is down, or while the core has work and has sent nothing for over
        ``--engine-stall-timeout`` (stopped, wedged: new requests would hang), until its next
        step. Only reports: nothing in flight is failed."""
        if getattr(state, "draining", False):
            return error_response(503, "the server is shutting down")
        if not engine.is_running:
            return error_response(503, "engine is not running")
        stalled = engine.stalled_for()
        if stalled is not None:
            return error_response(503, f"the engine core has made no step for {stalled:.1f} s "
                                       f"with requests in hand (--engine-stall-timeout "
                                       f"{engine.config.engine_stall_timeout:g})")
        return Response(status_code=200)

    def refresh_from_core() -> None:
        """The gauges and core totals from the core's latest snapshot (at each read)."""
        s = engine.stats
        metrics.set_queue_sizes(s.num_running, s.num_waiting)
        metrics.set_kv_usage(s.kv_cache_usage)
        metrics.set_prefix_cache_totals(s.prefix_cache_queries_total, s.prefix_cache_hits_total)
        metrics.set_grammar_compiles(s.num_grammar_compiles)
        metrics.set_kv_transfer(s.num_waiting_for_kv, s.kv_transfer_bytes_sent_total,
                                s.kv_transfer_bytes_received_total, s.kv_transfer_failures_total)

    @r.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition; queue and KV gauges from the core's latest snapshot."""
        refresh_from_core()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @r.get("/dashboard", response_model=None)
    async def dashboard() -> Response:
        """One self-contained HTML page over ``/stats/stream`` (no outside script or style)."""
        return Response(DASHBOARD_HTML, media_type="text/html; charset=utf-8")

    @r.get("/stats", response_model=None)
    async def stats(steps: bool = False) -> dict:
        """One JSON snapshot: sequence number, the /metrics values, the last minute's finished
        requests (``sloserve.stats``); ``steps=true``: the latest steps too."""
        refresh_from_core()
        return metrics.snapshot(0 if steps else None)

    @r.get("/stats/stream", response_model=None)
    async def stats_stream(raw: Request, interval: float = Query(1.0, ge=0.1, le=60.0),
                           steps: bool = False) -> Response:
        """``/stats`` as server-sent events, one snapshot every ``interval`` seconds until the
        client goes; ``steps=true``: each with the steps since the one before."""
        async def events():
            last = 0
            while not await raw.is_disconnected():
                refresh_from_core()
                snap = metrics.snapshot(last if steps else None)
                if snap.get("steps"):
                    last = snap["steps"][-1][0]
                yield sse(snap)
                await asyncio.sleep(interval)
        return SSEResponse(events(), headers={"cache-control": "no-cache"})

    @r.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Forget the prefix cache (blocks in use keep their tokens). 200, or 503 when the
        engine is down."""
        if not engine.is_running:
            raise APIError(503, "engine is not running")
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @r.get("/kv_transfer", response_model=KVTransferInfo)
    async def kv_transfer_info() -> KVTransferInfo:
        """Where this server's KV connector listens (``--kv-transfer-config``): its role,
        engine id, host, port and mode, for a router pairing prefill and decode instances.
        404 when the server has none."""
        info = engine.info
        if info.kv_role is None:
            raise APIError(404, "this server has no KV connector (start it with "
                                "--kv-transfer-config)")
        return KVTransferInfo(kv_role=info.kv_role, engine_id=info.kv_engine_id,
                              kv_host=info.kv_host, kv_port=info.kv_port, mode=info.kv_mode)

    @r.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The served model (one entry)."""
        return ModelList(data=[ModelCard(id=model_name, root=engine.model_path,
                                         max_model_len=engine.max_model_len)])

    @r.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        """OpenAI text completion. Errors: 400 (parameters), 404 (model), 500 (engine), 503."""
        check_model(body.model)
        check_admitting()
        b = CompletionBuilder(random_id("cmpl"), now_s(), model_name, fmt,
                              logprobs=body.logprobs is not None, echo=bool(body.echo),
                              prompt_logprobs=body.prompt_logprobs is not None)
        try:
            prompts = body.prompts()
        except ParamError as e:
            raise APIError(400, str(e), e.param) from e
        choices = await make_choices(prompts, body, b.id)
        res = reserve(choices, raw)
        if body.stream:
            return stream_response(engine, choices, body.include_usage, b, res,
                                   continuous_usage=body.continuous_usage)
        return await whole_response(engine, choices, raw, b, res)

    async def chat_prompt(body: ChatCompletionRequest) -> tuple[ToolPlan, list[int]]:
        """A chat request's tool plan and prompt (the template rendered, tokenized).

        Raises:
            APIError: 400 for no tokenizer, bad tools or messages, a template that fails.
        """
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so no chat template", "messages")
        try:
            plan = plan_tools(body, chat)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from e
        body._forced_structured = plan.structured

        def render() -> list[int]:
            try:
                body.unsupported()
                messages = [m.to_template_dict(chat.chat_template_content_format)
                            for m in body.messages]
                check_tool_messages(messages)
                return tok.apply_chat_template(messages,
                                               add_generation_prompt=body.add_generation_prompt,
                                               tools=plan.tools, chat_template=chat.chat_template)
            except ParamError as e:
                raise APIError(400, str(e), e.param) from e
            except Exception as e:  # no template (ValueError), template errors (jinja2), ...
                raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
        long = sum(len(str(m.content or "")) for m in body.messages) > OFFLOAD_CHARS
        return plan, (await asyncio.to_thread(render) if long else render())

    @r.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completion via the chat template. Errors: 400, 404, 500, 503."""
        check_model(body.model)
        check_admitting()
        plan, ids = await chat_prompt(body)
        b = ChatBuilder(random_id("chatcmpl"), now_s(), model_name, fmt,
                        logprobs=bool(body.logprobs), plan=plan,
                        reasoning_parser=reasoning_parser_for(chat, body))
        choices = await make_choices([ids], body, b.id)
        res = reserve(choices, raw)
        if body.stream:
            return stream_response(engine, choices, body.include_usage, b, res,
                                   continuous_usage=body.continuous_usage)
        return await whole_response(engine, choices, raw, b, res)

    def messages_body(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
        try:
            return to_chat_request(body)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from e
        except ValueError as e:  # the chat request's own validation
            raise APIError(400, f"invalid request: {e}") from e

    @r.post("/v1/messages", response_model=None)
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        """Anthropic's Messages API over the chat path (``messages_api``); errors in its
        shape. Errors: 400, 404, 429, 500, 503."""
        check_model(body.model)
        check_admitting()
        chat_body = messages_body(body)
        plan, ids = await chat_prompt(chat_body)
        b = MessagesBuilder(random_id("msg"), model_name, plan,
                            reasoning_parser_for(chat, chat_body))
        choices = await make_choices([ids], chat_body, b.id)
        res = reserve(choices, raw)
        if body.stream:
            return stream_response(engine, choices, False, b, res)
        return await whole_response(engine, choices, raw, b, res)

    responses = ResponseStore()

    @r.post("/v1/responses", response_model=None)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API over the chat path (``responses_api``). Errors: 400, 404
        (an unknown previous_response_id), 429, 500, 503."""
        check_model(body.model)
        check_admitting()
        history: list[dict] = []
        if body.previous_response_id is not None:
            got = responses.get(body.previous_response_id)
            if got is None:
                raise APIError(404, f"response {body.previous_response_id!r} not found (never "
                                    f"stored here, or evicted: the server keeps the "
                                    f"{responses.capacity} most recent)", "previous_response_id")
            history = got[1]
        try:
            conversation = history + input_messages(body.input)
            chat_body = responses_chat_request(body, conversation)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from e
        except ValueError as e:  # the chat request's own validation
            raise APIError(400, f"invalid request: {e}") from e
        try:  # the chat path's 400s, in the Responses API's field names
            plan, ids = await chat_prompt(chat_body)
            b = ResponsesBuilder(body, model_name, plan, conversation, responses,
                                 reasoning_parser_for(chat, chat_body))
            choices = await make_choices([ids], chat_body, b.id)
        except APIError as e:
            raise responses_error(e) from e
        res = reserve(choices, raw)
        if body.stream:
            return stream_response(engine, choices, False, b, res)
        return await whole_response(engine, choices, raw, b, res)

    @r.get("/v1/responses/{response_id}", response_model=None)
    async def get_response(response_id: str) -> dict:
        """A stored response (404: unknown or evicted)."""
        got = responses.get(response_id)
        if got is None:
            raise APIError(404, f"response {response_id!r} not found", "response_id")
        return got[0]

    @r.post("/v1/messages/count_tokens", response_model=None)
    async def count_message_tokens(body: CountTokensRequest) -> dict:
        """The prompt tokens a Messages request would have (``{"input_tokens": N}``); the
        tools render into the prompt whatever the choice, so an ``auto`` choice counts on a
        server without --enable-auto-tool-choice too."""
        check_model(body.model)
        chat_body = messages_body(body)
        if chat_body.tools and chat_body.tool_choice in (None, "auto"):
            chat_body = chat_body.model_copy(update={"tool_choice": "none"})
        _, ids = await chat_prompt(chat_body)
        return {"input_tokens": len(ids)}

    r.include_router(build_tokenization_router(engine, check_model))
    return r


def _spec_param(body) -> str:
    """The request field a structured-output spec that does not compile came from."""
    if getattr(body, "_forced_structured", None) is not None:
        return "tools"
    return "response_format" if body.response_format else "structured_outputs"
