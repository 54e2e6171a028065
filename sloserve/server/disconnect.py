"""Running a non-streamed request while watching for the client to go away."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import Request


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def wait_for_disconnect(raw: Request) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (the body is already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(outputs: Callable[[], AsyncIterator], raw: Request) -> list:
    """Collect every item of ``outputs()``, racing it against a client disconnect.

    Returns:
        The items in order.

    Raises:
        ClientDisconnected: the client went away (the iteration was left early, which aborts
            the request and frees its KV blocks).
        Exception: whatever the iteration raised.
    """

    async def consume() -> list:
        async with contextlib.aclosing(outputs()) as it:
            return [x async for x in it]

    gen_task = asyncio.ensure_future(consume())
    disc_task = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({gen_task, disc_task}, return_when=asyncio.FIRST_COMPLETED)
        if gen_task.done():
            return gen_task.result()
        raise ClientDisconnected()
    finally:
        for t in (gen_task, disc_task):
            if not t.done():
                t.cancel()
        # wait for the cancelled generation to leave engine.generate (that queues the abort)
        with anyio.CancelScope(shield=True):
            await asyncio.gather(gen_task, disc_task, return_exceptions=True)
