"""vLLM's tokenizer endpoints, for clients that cannot load the model's tokenizer themselves
(lm-evaluation-harness's ``tokenizer_backend=remote``):

    POST /tokenize         {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len",
                           "tokens", "token_strs"}
    POST /detokenize       {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info   the special tokens and the chat template

Errors: 400 for token ids outside the vocabulary or a chat template that fails, 404 for another
model's name, and 400 on any of them when the model has no tokenizer.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from sloserve.server.errors import APIError
from sloserve.server.protocol import ChatMessage, Int


#: a text longer than this (characters), or more token ids than this, is (de)tokenized off the
#: event loop
OFFLOAD_CHARS = 20_000
OFFLOAD_TOKENS = 20_000


class TokenizeRequest(BaseModel):
    """A text ``prompt``, or chat ``messages`` rendered through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


def build_tokenization_router(engine, check_model) -> APIRouter:
    """The three routes over ``engine``'s tokenizer; ``check_model`` raises 404 for another
    model's name."""
    r = APIRouter()

    def tokenizer():
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return engine.tokenizer

    @r.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> Response:
        check_model(body.model)
        tok = tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")

        def run() -> Response:
            try:
                if body.messages is not None:
                    text = tok.render_chat_template(
                        [m.to_template_dict() for m in body.messages],
                        add_generation_prompt=body.add_generation_prompt)
                    ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
                else:
                    ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                     is not False)
            except APIError:
                raise
            except Exception as e:  # no template, template errors, lone surrogates
                raise APIError(400, f"cannot tokenize: {e}",
                               "messages" if body.messages is not None else "prompt") from e
            strs = ([tok.hf.convert_ids_to_tokens(i) for i in ids] if body.return_token_strs
                    else None)
            return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                                 tokens=ids, token_strs=strs).model_dump())

        size = len(body.prompt) if body.prompt is not None else sum(
            len(str(m.content or "")) for m in body.messages)
        # a long text is tokenized (and its answer rendered) off the event loop, which keeps
        # answering /health and other streams meanwhile
        return await asyncio.to_thread(run) if size > OFFLOAD_CHARS else run()

    @r.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> Response:
        check_model(body.model)
        tok = tokenizer()
        vocab = tok.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:4]}", "tokens")
        def run() -> Response:
            return JSONResponse(DetokenizeResponse(
                prompt=tok.decode(body.tokens, skip_special_tokens=False)).model_dump())

        return await asyncio.to_thread(run) if len(body.tokens) > OFFLOAD_TOKENS else run()

    @r.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = tokenizer()
        hf = tok.hf
        return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token,
                "bos_token": hf.bos_token, "pad_token": hf.pad_token,
                "chat_template": tok.chat_template, "model_max_length": engine.max_model_len,
                "vocab_size": tok.vocab_size}

    return r
