"""A ZeroMQ SUB socket per worker that reads its KV cache events (vLLM's framing, see
``sloserve.engine.kv_events``) into the :class:`~sloserve.router.prefix_index.PrefixIndex`, on
the router's event loop.

Sequence numbers: a batch whose number runs past the next one expected means batches were
lost (the PUB socket drops past its high-water mark, and a subscriber misses what was sent
before it connected); with a replay endpoint the missing ones are asked for (vLLM's ROUTER
protocol), else the loss is logged and the index goes on with what it has. A number below the
expected one means the publisher restarted (a new engine, an empty cache): the worker's blocks
are forgotten first.
"""
from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from sloserve.engine.kv_events import END_SEQ, decode_event_batch
from sloserve.router.prefix_index import PrefixIndex

logger = logging.getLogger("sloserve.router")

#: seconds a replay request may take
REPLAY_TIMEOUT_S = 1.0


class KVEventSubscriber:
    """Follows one worker's events.

    Args:
        ctx: the router's asyncio ZeroMQ context.
        worker: the worker's URL (its key in the index).
        endpoint: its PUB socket (connected to).
        topic: the topic to subscribe to (a prefix, as ZeroMQ filters).
        replay_endpoint: its replay ROUTER socket, or None.
    """

    def __init__(self, ctx: zmq.asyncio.Context, worker: str, endpoint: str, topic: str,
                 replay_endpoint: str | None, index: PrefixIndex):
        self.ctx = ctx
        self.worker = worker
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.next_seq: int | None = None
        self.num_lost = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv events {self.worker}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        logger.info("reading KV events of %s from %s", self.worker, self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._on_message(frames)
                except Exception:  # one bad message must not end the subscription
                    logger.exception("KV event message from %s dropped", self.endpoint)
        finally:
            sub.close()

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            logger.warning("KV event message of %d frames from %s ignored", len(frames),
                           self.endpoint)
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        expected = self.next_seq
        if expected is not None and seq < expected:
            logger.warning("KV events of %s restarted at %d (expected %d): its cache is "
                           "assumed empty", self.worker, seq, expected)
            self.index.clear(self.worker)
        elif seq > (expected or 0):
            start = expected or 0
            if self.replay_endpoint is not None:
                await self._replay(start, seq)
            elif expected is not None:
                self.num_lost += seq - start
                logger.warning("KV events of %s: batches %d-%d lost", self.worker, start,
                               seq - 1)
        self.index.apply(self.worker, decode_event_batch(payload))
        self.next_seq = seq + 1

    async def _replay(self, start: int, stop: int) -> None:
        """Ask the replay socket for batches [start, stop) and apply them."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        got = 0
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    logger.warning("KV event replay from %s timed out", self.replay_endpoint)
                    break
                frames = await sock.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    break
                seq = int.from_bytes(frames[1], "big")
                if start <= seq < stop:
                    self.index.apply(self.worker, decode_event_batch(frames[2]))
                    got += 1
        finally:
            sock.close()
        if got < stop - start:
            self.num_lost += stop - start - got
            logger.warning("KV events of %s: %d of batches %d-%d could not be replayed",
                           self.worker, stop - start - got, start, stop - 1)
