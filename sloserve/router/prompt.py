"""A request's prompt token ids, as the worker's engine will see them (the prefix-aware policy
hashes them into blocks).

Two sources, both giving the server's own tokenization:

* a worker's ``POST /tokenize`` (the default; sloserve's and vLLM's endpoint): ``{"prompt"}``
  for a completion (special tokens added, as the completions route does), ``{"messages",
  "add_generation_prompt"}`` for a chat (rendered through the chat template, no special tokens
  added again, as the chat route does); one round trip to a replica per routed request;
* ``--tokenizer PATH``: the model's tokenizer loaded here (``sloserve.tokenizer``, no weights,
  no torch), the same calls the server makes, with the chat messages joined as the server
  joins them (text parts by newlines). A failure falls back to ``/tokenize``.

Token-id prompts need neither. A completion request with several prompts is routed by its
first one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

logger = logging.getLogger("sloserve.router")

#: seconds a worker's /tokenize may take before the request is routed without prefix info
TOKENIZE_TIMEOUT_S = 2.0
#: a chat or prompt longer than this (characters) is tokenized off the event loop (local)
OFFLOAD_CHARS = 20_000


def first_prompt(body: dict) -> str | list[int] | None:
    """A completion body's (first) prompt: text or token ids; None for anything else."""
    p = body.get("prompt")
    if isinstance(p, list) and p:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        p = p[0]
        if isinstance(p, list):
            return p if all(isinstance(t, int) and not isinstance(t, bool) for t in p) else None
    return p if isinstance(p, str) else None


def template_messages(messages: Any) -> list[dict] | None:
    """Chat messages as the server hands them to the chat template
    (``ChatMessage.to_template_dict``: text parts joined by newlines); None if any is not
    plain text."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    return None
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            return None
        d = {"role": m["role"], "content": content or ""}
        if m.get("name") is not None:
            d["name"] = m["name"]
        out.append(d)
    return out


class PromptTokenizer:
    """Token ids of request bodies.

    Args:
        client: the HTTP client for ``/tokenize``.
        tokenizer: a model path whose tokenizer to load here, or None.
    """

    def __init__(self, client: httpx.AsyncClient, tokenizer: str | None = None):
        self.client = client
        self.local = None
        if tokenizer is not None:
            from sloserve.tokenizer import load_model_tokenizer
            self.local = load_model_tokenizer(tokenizer)
            if self.local is None:
                raise ValueError(f"--tokenizer {tokenizer}: the model has no tokenizer")

    async def token_ids(self, body: dict, chat: bool, worker_url: str | None) -> list[int] | None:
        """The prompt's token ids, or None when they cannot be had (the request is then routed
        without prefix information); ``worker_url`` is asked when there is no local tokenizer."""
        if not chat:
            prompt = first_prompt(body)
            if prompt is None:
                return None
            if isinstance(prompt, list):
                return prompt
        if self.local is not None:
            try:
                return await self._local(body, chat)
            except Exception as e:  # noqa: BLE001 - the server would refuse it: it decides
                logger.debug("local tokenization failed (%s); asking a worker", e)
        if worker_url is None:
            return None
        return await self._remote(body, chat, worker_url)

    async def _local(self, body: dict, chat: bool) -> list[int] | None:
        tok = self.local
        if chat:
            messages = template_messages(body.get("messages"))
            if messages is None:
                raise ValueError("messages the router does not render")
            agp = body.get("add_generation_prompt", True)
            size = sum(len(m["content"]) for m in messages)

            def run():
                return tok.apply_chat_template(messages, add_generation_prompt=bool(agp))
        else:
            text = first_prompt(body)
            size = len(text)

            def run():
                return tok.encode(text)
        return await asyncio.to_thread(run) if size > OFFLOAD_CHARS else run()

    async def _remote(self, body: dict, chat: bool, worker_url: str) -> list[int] | None:
        req: dict[str, Any] = {}
        if body.get("model") is not None:
            req["model"] = body["model"]
        if chat:
            req["messages"] = body.get("messages")
            req["add_generation_prompt"] = body.get("add_generation_prompt", True)
        else:
            req["prompt"] = first_prompt(body)
        try:
            r = await asyncio.wait_for(
                self.client.post(worker_url + "/tokenize", json=req, timeout=TOKENIZE_TIMEOUT_S),
                TOKENIZE_TIMEOUT_S)
            if r.status_code != 200:
                logger.debug("%s/tokenize answered %d", worker_url, r.status_code)
                return None
            tokens = r.json().get("tokens")
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            logger.debug("%s/tokenize failed: %s", worker_url, e)
            return None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None
