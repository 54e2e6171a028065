"""One API request's HTTP flow, shared by ``/v1/completions``, ``/v1/chat/completions`` and the
APIs that run as chat completions (``messages_api``, ``responses_api``: their builders have the
same methods).

An API request becomes one engine request per choice (``n`` per prompt; completions may carry
several prompts): choice ``i`` of prompt ``p`` has index ``p * n + i``, as in vLLM. The choices
run together (``AsyncLLM.generate_group``); the endpoints differ only in their JSON shapes,
built by a :class:`CompletionBuilder` or a :class:`ChatBuilder` from per-choice
:class:`ChoiceState` and run through :func:`stream_response` or :func:`whole_response`. A
prompt's ``prompt_logprobs`` are computed once, by its first choice, and every choice of the
prompt answers with them (:class:`PromptLogprobsShare`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sloserve.engine.async_llm import AsyncLLM, Reservation
from sloserve.engine.messages import EngineCoreRequest
from sloserve.engine.outputs import RequestOutput
from sloserve.logprobs import Logprobs
from sloserve.server.disconnect import ClientDisconnected, run_until_disconnect
from sloserve.server.errors import APIError, engine_error
from sloserve.server.logprobs_format import LogprobsFormatter
from sloserve.server.protocol import (ChatCompletionChoice, ChatCompletionResponse,
                                      ChatCompletionStreamChoice, ChatCompletionStreamResponse,
                                      ChatLogProbs, ChatResponseMessage, CompletionChoice,
                                      CompletionResponse, CompletionStreamResponse,
                                      DeltaFunctionCall, DeltaMessage, DeltaToolCallModel,
                                      FunctionCall, ToolCallModel, UsageInfo,
                                      kv_transfer_params_to_json)
from sloserve.server.sse import DONE, SSEResponse, sse
from sloserve.server.tools import ChoiceOutput, ToolPlan, finish_reason

logger = logging.getLogger(__name__)

_CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it


@dataclass
class Choice:
    """One choice of an API request: its engine request, the prompt it belongs to, and (for
    ``echo``) the prompt's text to put before the completion."""

    request: EngineCoreRequest
    prompt_index: int = 0
    echo_text: str | None = None


@dataclass
class ChoiceState:
    """What has been produced for one choice so far."""

    choice: Choice
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs = field(default_factory=Logprobs.empty)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: Logprobs | None = None
    #: completions' text_offset of the next streamed token: the token texts streamed so far
    #: (as in the whole response, where each token's offset follows the previous token's text)
    lp_offset: int = 0
    started: bool = False    # its first output arrived
    final: RequestOutput | None = None
    #: chat: its streamed text through the reasoning and tool parsers (ChatBuilder's)
    parsed: ChoiceOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.token_ids += out.new_token_ids
        if out.new_logprobs is not None:
            self.logprobs.extend(out.new_logprobs)
        if out.prompt_token_ids is not None:
            self.prompt_token_ids = out.prompt_token_ids
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.final = out


class PromptLogprobsShare:
    """Prompt logprobs once per prompt, as vLLM answers them (one ``prompt_logprobs`` per
    prompt, given to each of its choices): the prompt's first choice whose request asks the
    engine for them computes them (``routes`` asks only the first), and every choice of that
    prompt answers with the same values. A sibling's outputs that arrive before its prompt's
    logprobs wait for them, in order (:meth:`release`)."""

    def __init__(self, states: list[ChoiceState]):
        self._source: dict[int, ChoiceState] = {}
        for st in states:
            if st.choice.request.sampling_params.prompt_logprobs is not None:
                self._source.setdefault(st.choice.prompt_index, st)
        self._held: dict[int, list[tuple[ChoiceState, RequestOutput]]] = {}

    def release(self, st: ChoiceState, out: RequestOutput
                ) -> list[tuple[ChoiceState, RequestOutput]]:
        """The outputs to handle now, in order, once `out` of `st` arrived: none while its
        prompt's logprobs are still to come; the held ones of its siblings after the output
        that brings them."""
        p = st.choice.prompt_index
        src = self._source.get(p)
        if src is st:
            return [(st, out)] + self._held.pop(p, [])
        if src is not None and not src.started:
            self._held.setdefault(p, []).append((st, out))
            return []
        return [(st, out)]

    def fill(self, st: ChoiceState) -> None:
        """Give `st`, once its first output is in, its prompt's shared logprobs."""
        src = self._source.get(st.choice.prompt_index)
        if src is not None and src is not st and st.prompt_token_ids is not None:
            st.prompt_logprobs = src.prompt_logprobs


def usage_of(states: list[ChoiceState]) -> UsageInfo:
    """Prompt tokens once per prompt (its choices share it), completion tokens summed over
    choices, cached tokens the most any choice of a prompt found (its siblings reuse the first
    one's blocks)."""
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for st in states:
        f = st.final
        if f is None:
            continue
        n, c = prompts.get(st.choice.prompt_index, (0, 0))
        prompts[st.choice.prompt_index] = (max(n, f.num_prompt_tokens), max(c, f.num_cached_tokens))
        completion += f.num_output_tokens
    return UsageInfo.of(sum(n for n, _ in prompts.values()), completion,
                        sum(c for _, c in prompts.values()))


def kv_transfer_of(states: list[ChoiceState]) -> dict | None:
    """The response's ``kv_transfer_params``: the first finished choice's that has them (a
    request with them has one choice), None when none has."""
    for st in states:
        if st.final is not None and st.final.kv_transfer_params is not None:
            return kv_transfer_params_to_json(st.final.kv_transfer_params)
    return None


def _chunk_kv_transfer(out: RequestOutput) -> dict | None:
    """A streamed chunk's ``kv_transfer_params``: the finished output's, None before."""
    return kv_transfer_params_to_json(out.kv_transfer_params) if out.finished else None


class _OpenAIEvents:
    """How OpenAI's streams end and fail."""

    def done(self) -> str:
        return DONE

    def error_event(self, err: APIError) -> str:
        return sse(err.body().model_dump())  # a dict: rendered ASCII-safe


@dataclass
class CompletionBuilder(_OpenAIEvents):
    """JSON shapes of ``/v1/completions``."""

    id: str
    created: int
    model: str
    fmt: LogprobsFormatter
    logprobs: bool = False   # the request asked for logprobs
    echo: bool = False
    prompt_logprobs: bool = False  # the request asked for prompt_logprobs (vLLM's field)

    def _prompt_logprobs(self, st: ChoiceState, first: bool):
        if not (first and self.prompt_logprobs and st.prompt_token_ids):
            return None
        return self.fmt.prompt(st.prompt_logprobs)

    def _logprobs(self, st: ChoiceState, ids: list[int], lp: Logprobs | None, first: bool,
                  offset: int):
        if not self.logprobs:
            return None
        runs: list[Logprobs | None] = []
        toks: list[int] = []
        if first and self.echo and st.prompt_token_ids:
            toks += st.prompt_token_ids
            runs += [None, st.prompt_logprobs or Logprobs.empty()]
        toks += ids
        runs.append(lp or Logprobs.empty())
        return self.fmt.completion(toks, runs, offset)

    def preamble(self, st: ChoiceState) -> list[str]:
        return []

    def chunk(self, st: ChoiceState, out: RequestOutput, first: bool,
              usage: UsageInfo | None = None) -> str | None:
        text = ((st.choice.echo_text or "") if first and self.echo else "") + out.new_text
        lp = self._logprobs(st, out.new_token_ids, out.new_logprobs, first, st.lp_offset)
        if lp is not None:
            st.lp_offset += sum(len(t) for t in lp.tokens)
        if not text and not out.finished and not (lp and lp.tokens) and not (
                first and self.prompt_logprobs):
            return None
        return sse(CompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[CompletionChoice(index=st.index, text=text, logprobs=lp,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      prompt_logprobs=self._prompt_logprobs(st, first))],
            usage=usage, kv_transfer_params=_chunk_kv_transfer(out)))

    def usage_chunk(self, usage: UsageInfo) -> str:
        return sse(CompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                            choices=[], usage=usage))

    def response(self, states: list[ChoiceState]) -> BaseModel:
        choices = []
        for st in states:
            echo = (st.choice.echo_text or "") if self.echo else ""
            choices.append(CompletionChoice(
                index=st.index, text=echo + "".join(st.text),
                logprobs=self._logprobs(st, st.token_ids, st.logprobs, True, 0),
                finish_reason=st.final.finish_reason,
                prompt_logprobs=self._prompt_logprobs(st, True)))
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=usage_of(states),
                                  kv_transfer_params=kv_transfer_of(states))


@dataclass
class ChatBuilder(_OpenAIEvents):
    """JSON shapes of ``/v1/chat/completions``."""

    id: str
    created: int
    model: str
    fmt: LogprobsFormatter
    logprobs: bool = False
    plan: ToolPlan = field(default_factory=ToolPlan)
    reasoning_parser: str | None = None

    def _output(self) -> ChoiceOutput:
        return ChoiceOutput(self.plan, self.reasoning_parser)

    def preamble(self, st: ChoiceState) -> list[str]:
        """The role chunk, sent with the choice's first token (as vLLM does), so a client that
        times the first event with choices measures the real TTFT."""
        return [sse(ChatCompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(index=st.index,
                                                delta=DeltaMessage(role="assistant",
                                                                   content=""))]))]

    def _logprobs(self, lp: Logprobs | None) -> ChatLogProbs | None:
        if not self.logprobs:
            return None
        return ChatLogProbs(content=self.fmt.chat(lp or Logprobs.empty()))

    def chunk(self, st: ChoiceState, out: RequestOutput, first: bool,
              usage: UsageInfo | None = None) -> str | None:
        lp = self._logprobs(out.new_logprobs)
        if st.parsed is None:
            st.parsed = self._output()
        reasoning, content, calls = st.parsed.feed(out.new_text, last=out.finished)
        if not (reasoning or content or calls) and not out.finished and not (lp and lp.content):
            return None
        delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                             tool_calls=[_delta_call(d) for d in calls] or None)
        reason = finish_reason(out.finish_reason, st.parsed.called) if out.finished else None
        return sse(ChatCompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatCompletionStreamChoice(
                index=st.index, delta=delta, logprobs=lp, finish_reason=reason)],
            usage=usage, kv_transfer_params=_chunk_kv_transfer(out)))

    def usage_chunk(self, usage: UsageInfo) -> str:
        return sse(ChatCompletionStreamResponse(id=self.id, created=self.created,
                                                model=self.model, choices=[], usage=usage))

    def response(self, states: list[ChoiceState]) -> BaseModel:
        choices = []
        for st in states:
            parsed = self._output()
            reasoning, content, calls = parsed.whole("".join(st.text))
            if content is None and not (calls or reasoning):
                content = ""  # a plain answer's content is a string, also when empty
            choices.append(ChatCompletionChoice(
                index=st.index, message=ChatResponseMessage(
                    content=content, reasoning_content=reasoning,
                    tool_calls=[ToolCallModel(id=c.id, function=FunctionCall(
                        name=c.name, arguments=c.arguments)) for c in calls]),
                logprobs=self._logprobs(st.logprobs),
                finish_reason=finish_reason(st.final.finish_reason, bool(calls))))
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=usage_of(states), kv_transfer_params=kv_transfer_of(states))


def _delta_call(d) -> DeltaToolCallModel:
    """A ``tool_parsers.ToolCallDelta`` as OpenAI streams it."""
    if d.id is not None:
        return DeltaToolCallModel(index=d.index, id=d.id, type="function",
                                  function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
    return DeltaToolCallModel(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))


#: (``messages_api.MessagesBuilder`` and ``responses_api.ResponsesBuilder`` have the same methods)
ResponseBuilder = CompletionBuilder | ChatBuilder


def _failed(out: RequestOutput) -> APIError:
    """The error of a choice the engine failed: 400 when the request itself cannot be served
    (a structured-output spec no string satisfies), else 500."""
    return APIError(400 if out.bad_request else 500, out.error)


async def _events(engine: AsyncLLM, choices: list[Choice], include_usage: bool,
                  b: ResponseBuilder, reservation: Reservation | None = None,
                  continuous_usage: bool = False) -> AsyncIterator[str]:
    """SSE events of one API request: per choice its preamble with its first output, then its
    content chunks (``continuous_usage``: each with that choice's usage so far, vLLM's
    ``continuous_usage_stats``); optional usage once every choice finished; ``[DONE]``. A
    failure mid-stream is an error event before ``[DONE]``."""
    states = [ChoiceState(c, i) for i, c in enumerate(choices)]
    share = PromptLogprobsShare(states)
    failed = False
    try:
        gen = engine.generate_group([c.request for c in choices], reservation)
        async with contextlib.aclosing(gen) as outs:
            async for i, out in outs:
                if out.error:
                    logger.error("request %s failed: %s", out.request_id, out.error)
                    yield b.error_event(_failed(out))
                    failed = True
                    break
                for st, o in share.release(states[i], out):
                    first = not st.started
                    st.started = True
                    st.add(o)
                    share.fill(st)
                    if first:
                        for ev in b.preamble(st):
                            yield ev
                    ev = (b.chunk(st, o, first, usage=UsageInfo.of(
                        o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens))
                        if continuous_usage else b.chunk(st, o, first))
                    if ev is not None:
                        yield ev
    except Exception as e:  # engine died or refused (CancelledError is not an Exception)
        yield b.error_event(engine_error(e))
    else:
        if include_usage and not failed and all(st.final is not None for st in states):
            ev = b.usage_chunk(usage_of(states))
            if ev:
                yield ev
    if b.done():
        yield b.done()


def stream_response(engine: AsyncLLM, choices: list[Choice], include_usage: bool,
                    b: ResponseBuilder, reservation: Reservation | None = None,
                    continuous_usage: bool = False) -> Response:
    """The streamed (SSE) answer; a client that disconnects aborts every choice. The
    choices' ``reservation`` (``AsyncLLM.reserve``) is given back when the response ends, also
    if its body never started (a client gone before the first byte)."""
    return SSEResponse(_events(engine, choices, include_usage, b, reservation,
                               continuous_usage),
                       on_close=reservation.release if reservation is not None else None)


async def whole_response(engine: AsyncLLM, choices: list[Choice], raw: Request,
                         b: ResponseBuilder, reservation: Reservation | None = None
                         ) -> Response:
    """Run every choice to the end and answer the JSON (``reservation``: as for
    :func:`stream_response`).

    Raises:
        APIError: 500 when the engine failed a choice, 503 when the core is down. A client
            that went away gets no body (the requests are aborted).
    """
    try:
        outs = await run_until_disconnect(
            lambda: engine.generate_group([c.request for c in choices], reservation), raw)
    except ClientDisconnected:
        logger.info("client disconnected, aborted %s", b.id)
        return Response(status_code=_CLIENT_CLOSED)
    except Exception as e:
        raise engine_error(e) from e
    finally:  # a generation cancelled before it started never ran its own release
        if reservation is not None:
            reservation.release()
    states = [ChoiceState(c, i) for i, c in enumerate(choices)]
    for i, out in outs:
        if out.error:
            raise _failed(out)
        states[i].add(out)
    share = PromptLogprobsShare(states)
    for st in states:
        share.fill(st)
    body = b.response(states)
    return JSONResponse(body if isinstance(body, dict) else body.model_dump())
