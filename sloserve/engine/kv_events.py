"""KV cache events in vLLM's format, and their ZeroMQ publisher (vLLM's ``ZmqEventPublisher``).

With ``--kv-events-config`` an engine tells the world what its prefix cache holds: a
``BlockStored`` when full blocks get their hash (are cached), a ``BlockRemoved`` when a cached
block is evicted to hold new tokens, an ``AllBlocksCleared`` when the prefix cache is reset
(``POST /reset_prefix_cache``). A router (``sloserve router --routing-policy prefix-aware``)
subscribes and keeps, per replica, the set of block hashes it holds.

Wire format (vLLM's ``vllm/distributed/kv_events.py``): a ZeroMQ PUB socket sends each batch as
a three-frame message

    topic (UTF-8, the config's ``topic``) | sequence number (8 bytes, big-endian, from 0) |
    payload (msgpack of :class:`KVEventBatch`)

The payload is a map ``{ts, events[, data_parallel_rank]}``; each event a map tagged with its
class name in ``"type"`` (msgspec's ``tag=True``), every field present (vLLM's consumers declare
``lora_id`` and ``medium`` without defaults). With a ``replay_endpoint`` a ROUTER socket answers
a request ``[b"", start_seq (8 bytes big-endian)]`` with ``[b"", seq, payload]`` for every
buffered batch from ``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``.
:func:`decode_event_batch` also reads the older array-encoded form (vLLM < 0.11,
``array_like=True``).

Block hashes on the wire are 64-bit unsigned ints: the engine's SHA-256 block hash
(``sloserve.engine.block_hash``) read big-endian, its low 64 bits (:func:`external_block_hash`,
the form vLLM sends by default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``). A router computes
the engine's hashes of a prompt's blocks with ``block_hash.extend_block_hashes`` (same token
ids, block size and ``cache_salt``) and compares their external forms.

The block pool records events as plain tuples (``sloserve.engine.block_pool``, which must not
read a clock); :func:`events_from_records` turns them into the structs here, in the publisher's
thread, merging a run of chained ``BlockStored`` records into one event (as vLLM does per
request) and a run of ``BlockRemoved`` records into one.

The engine core process wires it (``--kv-events-config``)::

    publisher = KVEventPublisher(config)     # binds; ValueError: bad config, endpoint taken
    core.kv.pool.enable_kv_events()
    ... after every step and every reset:  publisher.publish(core.kv.pool.take_events())
    ... on exit:                           publisher.close()
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Iterable, Union

import msgspec

from sloserve.argtypes import json_object

logger = logging.getLogger(__name__)

#: a block hash as events carry it (this module sends ints; bytes are read too)
ExternalBlockHash = Union[int, bytes]

_MASK64 = (1 << 64) - 1


def external_block_hash(block_hash: bytes) -> int:
    """The event form of an engine block hash: its bytes read big-endian, low 64 bits."""
    return int.from_bytes(block_hash, "big") & _MASK64


def normalize_block_hash(h: ExternalBlockHash) -> int:
    """An event's hash as an int (a bytes hash, from a producer that sends bytes, in the
    form :func:`external_block_hash` gives)."""
    return h if isinstance(h, int) else external_block_hash(h)


# ----------------------------------------------------------------------------- event structs
class KVCacheEvent(msgspec.Struct, gc=False, tag=True):
    """Base of the three events (tagged with the class name, field ``type``)."""


class BlockStored(KVCacheEvent):
    """Full blocks got their hashes: ``block_hashes`` in chain order, the first one's parent
    ``parent_block_hash`` (None: the first block of a prompt, or unknown), their ``token_ids``
    (``len(block_hashes) * block_size`` of them; empty when the engine did not say)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (their hashes serve no more hits)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: no hash is held any more."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The events of one publish call, ``ts`` the wall-clock time (s) they were handed over."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_FIELDS = {c.__name__: [f.name for f in msgspec.structs.fields(c)]
           for c in (BlockStored, BlockRemoved, AllBlocksCleared)}
_CLASSES = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


def encode_event_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def _event_of(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        name = raw.get("type")
        cls = _CLASSES.get(name)
        if cls is None:
            return None
        fields = {k: v for k, v in raw.items() if k in _FIELDS[name]}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        cls = _CLASSES.get(raw[0])
        if cls is None:
            return None
        fields = dict(zip(_FIELDS[raw[0]], raw[1:]))
    else:
        raise ValueError(f"not a KV cache event: {raw!r:.80}")
    return msgspec.convert(fields, cls)


def decode_event_batch(payload: bytes) -> KVEventBatch:
    """A payload as a :class:`KVEventBatch`, from the map form (this module's, vLLM >= 0.11) or
    the array form (older vLLM); unknown event types and fields are skipped.

    Raises:
        ValueError: not a msgpack event batch.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
        if isinstance(raw, dict):
            ts, events, rank = raw.get("ts", 0.0), raw.get("events", []), \
                raw.get("data_parallel_rank")
        elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
            ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
        else:
            raise ValueError(f"not a KV event batch: {raw!r:.80}")
        out = [e for e in (_event_of(r) for r in events) if e is not None]
        return KVEventBatch(float(ts), out, rank)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"undecodable KV event batch: {e}") from None


def events_from_records(records: Iterable[tuple]) -> list[KVEvent]:
    """The block pool's records (see ``block_pool``) as events, in order: a run of
    ``BlockStored`` records each chained to the one before (its parent is the previous hash)
    becomes one event, as does a run of ``BlockRemoved`` records."""
    out: list[KVEvent] = []
    last_hash: bytes | None = None  # the engine hash ending the last BlockStored in out
    has_tokens = False
    for r in records:
        kind = r[0]
        prev = out[-1] if out else None
        if kind == "BlockStored":
            _, h, parent, tokens, block_size = r
            if (isinstance(prev, BlockStored) and parent is not None and parent == last_hash
                    and prev.block_size == block_size and has_tokens == (tokens is not None)):
                prev.block_hashes.append(external_block_hash(h))
                if tokens is not None:
                    prev.token_ids.extend(tokens)
            else:
                out.append(BlockStored(
                    [external_block_hash(h)],
                    None if parent is None else external_block_hash(parent),
                    list(tokens) if tokens is not None else [], block_size))
                has_tokens = tokens is not None
            last_hash = h
            continue
        last_hash = None
        if kind == "BlockRemoved":
            if isinstance(prev, BlockRemoved):
                prev.block_hashes.append(external_block_hash(r[1]))
            else:
                out.append(BlockRemoved([external_block_hash(r[1])]))
        elif kind == "AllBlocksCleared":
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event record {kind!r}")
    return out


# ---------------------------------------------------------------------------------- config
class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``--kv-events-config`` (same JSON keys and defaults).

    Attributes:
        enable_kv_cache_events: publish at all.
        publisher: ``"zmq"`` (the default when enabled) or ``"null"``.
        endpoint: the PUB socket: bound when it names no host (``tcp://*:5557``, ``ipc://``,
            ``inproc://``), else connected (to a forwarder).
        replay_endpoint: a ROUTER socket (bound) that replays buffered batches, or None.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark (messages queued per subscriber before drops).
        max_queue_size: batches waiting for the publisher thread before new ones are dropped.
        topic: the first frame of every message (subscribers filter on it).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got "
                             f"{self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def of(cls, value: "KVEventsConfig | dict | str") -> "KVEventsConfig":
        """From the struct itself, a dict, or the JSON text of the flag.

        Raises:
            ValueError: not JSON, an unknown key, a value of the wrong type.
        """
        if isinstance(value, cls):
            return value
        value = json_object(value, "--kv-events-config")
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"--kv-events-config: {e}") from None


def binds(endpoint: str) -> bool:
    """Whether a PUB endpoint is bound (vLLM's rule: a wildcard host, ipc:// or inproc://)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


# ------------------------------------------------------------------------------- publisher
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Publishes KV event batches on a ZeroMQ PUB socket from its own thread (the step loop
    only queues them), with an optional replay socket (see the module docstring).

    Args:
        config: a :class:`KVEventsConfig`, dict or JSON text; must be enabled.

    Raises (constructor):
        ValueError: a bad or disabled config, or an endpoint that cannot be bound (in use,
            malformed) or connected.
    """

    #: seconds ``close`` waits for queued batches to go out
    CLOSE_TIMEOUT_S = 1.0

    def __init__(self, config: "KVEventsConfig | dict | str"):
        import zmq

        cfg = self.config = KVEventsConfig.of(config)
        if not cfg.enabled:
            raise ValueError("KVEventPublisher needs enable_kv_cache_events and the zmq "
                             "publisher")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, int(self.CLOSE_TIMEOUT_S * 1000))
            if binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:  # taken, malformed: the user's setting to fix
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {cfg.endpoint}"
                             f"{' / ' + cfg.replay_endpoint if cfg.replay_endpoint else ''}: "
                             f"{e}") from None
        except BaseException:
            self._close_sockets()
            raise
        #: the endpoint actually bound (a tcp port 0 becomes the port chosen)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() or cfg.endpoint
        self.replay_endpoint = (self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
                                if self._replay is not None else None)
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._closed = False
        #: batches dropped because the queue was full
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="sloserve-kv-events",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one batch: block-pool records (``take_events``) or event structs; an empty
        list is ignored. Never blocks: a full queue drops the batch (counted, logged)."""
        if not events:
            return
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped", self.num_dropped)

    def close(self) -> None:
        """Send what is queued (up to ``CLOSE_TIMEOUT_S``), stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=self.CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(timeout=self.CLOSE_TIMEOUT_S + 0.5)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread did not stop")
            return  # its sockets are still in use; the daemon thread dies with the process
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close()
        self._ctx.term()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # a malformed request must not stop publishing
                    logger.exception("KV event replay failed")
            try:
                item = self._queue.get(timeout=0.05 if self._replay is not None else None)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                if not isinstance(events[0], KVCacheEvent):
                    events = events_from_records(events)
                payload = encode_event_batch(KVEventBatch(ts, events))
                seq = self._seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._seq += 1
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("KV event batch not published")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
