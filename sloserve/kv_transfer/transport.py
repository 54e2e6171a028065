"""The KV connector's wire: one TCP connection per transfer, length-prefixed msgpack headers,
raw KV payloads after ``kv`` headers, and the sender's token bucket. No torch.

A transfer's messages (either side may have opened the connection: push, the prefill side
connects to the decode side; pull, the other way round):

* ``hello`` {transfer_id, kind}: the opener's first message (kind ``push``: the opener sends
  the KV; ``pull``: the opener receives it);
* ``need`` {first_block, host?}: the receiving side, once it knows its blocks: send blocks from
  this index of the prompt's block table on (the ones below are cached there); ``host``
  (``transport: shm`` there): its host identity, shared memory welcome;
* ``shm`` {name, nbytes} (``transport: shm`` on both sides, one host): the sending side's
  shared-memory segment for the whole transfer (``sloserve.kv_transfer.shm``), before any ``kv``;
* ``kv`` {layer, b0, b1, nbytes} then ``nbytes`` of payload: one layer's KV of the prompt's
  blocks [b0, b1) in the attention backend's export layout; after a ``shm`` message
  {layer, b0, b1, nbytes, off} and no payload: the KV is in the segment at ``off``;
* ``done`` {output_token_ids, num_computed_tokens}: the last message of a transfer;
* ``error`` {message}: either side gives up (the other fails the transfer).

A frame is a 4-byte big-endian header length, then the msgpack header.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec

_LEN = struct.Struct(">I")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict)
#: payloads go out in pieces of at most this many bytes (the token bucket's grain)
CHUNK = 1 << 20


class TransferError(RuntimeError):
    """The other side closed the connection, sent an error or something malformed."""


def send_msg(sock: socket.socket, header: dict) -> None:
    data = _enc.encode(header)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise TransferError("the other side closed the connection")
        got += k
    return buf


def recv_msg(sock: socket.socket) -> dict:
    """The next header; raises TransferError for a closed connection or an ``error`` message."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > 1 << 20:
        raise TransferError(f"a header of {n} bytes: not a KV connector")
    try:
        msg = _dec.decode(_recv_exact(sock, n))
    except msgspec.DecodeError as e:
        raise TransferError(f"undecodable header: {e}") from None
    if msg.get("t") == "error":
        raise TransferError(f"the other side: {msg.get('message')}")
    return msg


def expect(msg: dict, kind: str) -> dict:
    if msg.get("t") != kind:
        raise TransferError(f"expected a {kind!r} message, got {msg.get('t')!r}")
    return msg


def recv_payload(sock: socket.socket, buf: memoryview) -> None:
    """Fill ``buf`` (a writable memoryview of the payload's size) from the socket."""
    _recv_exact(sock, len(buf), buf)


class TokenBucket:
    """At most ``rate`` bytes/s on average, in bursts of at most ``burst`` bytes (None rate:
    no limit). Thread-safe: the connections of one sender share it, as they share the link."""

    def __init__(self, rate: float | None, burst: int = CHUNK):
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may go."""
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def send_payload(sock: socket.socket, data: memoryview, bucket: TokenBucket) -> None:
    """Send ``data`` in pieces, each after the bucket lets it go."""
    for i in range(0, len(data), CHUNK):
        piece = data[i:i + CHUNK]
        bucket.take(len(piece))
        sock.sendall(piece)


def connect(host: str, port: int, deadline: float) -> socket.socket:
    """A connection to ``host:port``, retried until ``deadline`` (monotonic s) while refused
    (the other side may still be starting). Raises TransferError after it."""
    last = None
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise TransferError(f"cannot connect to {host}:{port}: {last}")
        time.sleep(0.05)
