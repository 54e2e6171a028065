"""The KV connector's worker half (vLLM's ``KVConnectorBase_V1`` worker-side methods): it
moves a prompt's KV between the KV cache tensors of a prefill instance and a decode instance
over TCP (``sloserve.kv_transfer.transport``), or through a shared-memory segment
(``sloserve.kv_transfer.shm``, ``transport: shm``, the two on one host), beside the step loop.

Each instance listens on ``kv_ip:kv_port``; a transfer is one connection, opened by the
prefill side (push) or the decode side (pull), named by its ``transfer_id``.

Prefill side (a :class:`~sloserve.step_io.KVSave`): the blocks of the prompt go layer by layer.
``layerwise``: after each layer's attention has written its KV in a step
(:meth:`save_kv_layer`, called from inside the model's forward), that layer's blocks completed
by the step are queued; ``eager``: every layer's blocks are queued after the step that ends the
prompt (:meth:`wait_for_save`). Blocks computed before (prefix-cache hits here, or a recompute
after preemption) are queued at the step's start. The forward only queues (block ids, no copy):
a sender thread per transfer copies each queued layer's blocks out of the cache and sends them
(through a token bucket shared by all transfers when ``max_bandwidth`` is set), skipping the
blocks the decode side said it has (``need``), then the first token sampled after the prompt
(``done``). The scheduler holds the request's blocks until the transfer is reported finished or
failed, so the blocks a sender reads are never reused meanwhile.

Decode side (a :class:`~sloserve.step_io.KVLoad`): a receiver thread per transfer writes each
arriving layer's blocks into the request's blocks (which no step reads until the transfer is
reported finished: the request waits in the scheduler), so arriving KV never stalls a step and
:meth:`wait_for_layer_load` has nothing to wait for.

Cancelled transfers (``KVConnectorMetadata.cancels``) stop before the next copy in or out and
are reported like failed ones; only then does the scheduler free their blocks.

``transport: shm``: the TCP connection still carries every header. The decode side's ``need``
names its host (:func:`~sloserve.kv_transfer.shm.host_identity`); a prefill side configured
with shm on the same host makes one segment for the whole transfer (layers x blocks to send x
a layer's block bytes), names it (``shm``) and writes each frame's blocks into it at the
``off`` its ``kv`` header carries, unthrottled (the token bucket models a link); the decode
side imports straight from the mapped segment. Another host (or a decode side without shm):
TCP for that transfer, one warning per peer. The segment's name goes when the decode side has
mapped it (it says ``mapped``, which the prefill side waits for before ``done``: a loaded
decode side may read ``shm`` after the last frame was written) and, in any case, when the
transfer ends (:meth:`_finish`); each side unmaps it when its thread for the transfer stops.
"""
from __future__ import annotations

import collections
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from sloserve.config import KVTransferConfig
from sloserve.kv_transfer import shm
from sloserve.kv_transfer.transport import (TokenBucket, TransferError, connect, expect,
                                            recv_msg, recv_payload, send_msg, send_payload)
from sloserve.step_io import (KVConnectorMetadata, KVConnectorOutput, KVLoad, KVReceived,
                              KVSave, SchedulerOutput)

logger = logging.getLogger(__name__)

#: a queued "the first token" item of a send transfer
_DONE = "done"
#: most first tokens a decode side takes with a prompt's KV (the prefill side samples one)
MAX_FIRST_TOKENS = 16


@dataclass(eq=False)
class _Transfer:
    transfer_id: str
    request_id: str
    num_prompt_tokens: int
    #: open, done, failed, cancelled
    state: str = "open"
    #: guards reading or writing the request's blocks against a cancel
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    started: float = field(default_factory=time.monotonic)
    #: transport shm: the transfer's segment (set under ``lock`` by the transfer's thread)
    segment: shm.Segment | None = None


@dataclass(eq=False)
class _Send(_Transfer):
    remote: tuple[str, int] | None = None
    #: (layer, b0, b1, block ids) or (_DONE, tokens, num_computed)
    frames: collections.deque = field(default_factory=collections.deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: blocks of the prompt queued so far (in order from 0)
    covered: int = 0
    attached: bool = False


@dataclass(eq=False)
class _Recv(_Transfer):
    load: KVLoad | None = None


class SloserveConnectorWorker:
    """The worker half of ``SloserveConnector``.

    Args:
        config: the KV transfer settings.
        kv_caches: the worker's KV cache tensors, one per layer (the backend's layout).
        attn_backend: exports and imports blocks of one layer (it owns the layout).
        block_size: tokens per block.
        vocab_size: the first tokens a decode side takes must be below it.

    Raises (constructor): OSError when ``kv_ip:kv_port`` cannot be listened on.
    """

    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], attn_backend,
                 block_size: int, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self.kv_caches = kv_caches
        self.backend = attn_backend
        self.block_size = block_size
        empty = attn_backend.export_blocks(kv_caches[0], torch.empty(0, dtype=torch.long))
        #: one layer's export shape with the block dimension, and its bytes per block
        self._shape = list(empty.shape)
        self._block_dim = self._shape.index(0)
        per_block = math.prod(d for i, d in enumerate(self._shape) if i != self._block_dim)
        self.layer_block_bytes = per_block * empty.element_size()
        self._dtype = kv_caches[0].dtype
        self._lock = threading.Condition()  # the registries below and the reports
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._by_request: dict[str, _Transfer] = {}
        self._finished_sending: list[str] = []
        self._finished_recving: list[KVReceived] = []
        self._failed: dict[str, str] = {}
        self._load_error_blocks: set[int] = set()
        self.bytes_sent = self.bytes_received = self.failures = 0
        self.bucket = TokenBucket(config.max_bandwidth)
        #: this step's saves: (transfer, first block the step completes, blocks ready after it)
        self._active: list[tuple[_Send, int, int, list[int], bool]] = []
        #: called (from any thread) when a transfer finishes or fails: wakes an idle core loop
        self.wake = None
        #: tests: called with each received payload (writable: a bytearray, or a memoryview of
        #: the shared-memory segment) before it is written
        self.on_receive = None
        #: where shared memory reaches (the identity a decode side's ``need`` carries)
        self.host_identity = shm.host_identity()
        self._tcp_warned: set = set()  # peers warned of (transport shm, sent over TCP)
        if config.transport == "shm":
            shm.prepare()
        #: benchmarks: a list to append (time.monotonic(), event, bytes) to: "forward_start"
        #: and "forward_end" of steps that advance a save, "received" per KV frame written
        #: (cumulative bytes), "done" per finished load; None: not recorded
        self.events: list | None = None
        self._closed = False
        try:
            self._server = socket.create_server((config.kv_ip, config.kv_port), backlog=64)
        except OSError as e:
            raise OSError(f"kv_transfer_config: the KV connector cannot listen on "
                          f"{config.kv_ip}:{config.kv_port}: {e.strerror or e} (another "
                          f"instance's kv_port? each needs its own)") from None
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="sloserve-kv-accept", daemon=True).start()

    # ------------------------------------------------------------------ registry
    def bind_connector_metadata(self, out: SchedulerOutput) -> None:
        """Take a step's news: new transfers, cancels, preempted requests (their queued blocks
        are dropped: recomputed blocks are queued again), and which saves this step's chunks
        advance."""
        meta = out.kv_connector_metadata or KVConnectorMetadata()
        for rid in meta.cancels:
            self._stop(rid, "cancelled")
        for s in meta.saves:
            t = _Send(s.transfer_id, s.request_id, s.num_prompt_tokens,
                      remote=(s.remote_host, s.remote_port) if s.remote_host else None)
            self._register(t, self._sends)
            if t.remote is not None:  # push: open the connection now, while the prompt computes
                threading.Thread(target=self._open_push, args=(t,), daemon=True,
                                 name="sloserve-kv-push").start()
        for ld in meta.loads:
            r = _Recv(ld.transfer_id, ld.request_id, ld.num_prompt_tokens, load=ld)
            self._register(r, self._recvs)
            if ld.remote_host:  # pull: ask the prefill side
                threading.Thread(target=self._open_pull, args=(r,), daemon=True,
                                 name="sloserve-kv-pull").start()
        for rid in out.preempted_request_ids:
            t = self._by_request.get(rid)
            if isinstance(t, _Send):
                with t.cond:
                    t.frames.clear()
                    t.covered = 0
        self._active = []
        bs = self.block_size
        if self.events is not None and any(sr.request_id in self._by_request
                                           for sr in out.scheduled):
            self.events.append((time.monotonic(), "forward_start", 0))
        for sr in out.scheduled:
            t = self._by_request.get(sr.request_id)
            if not isinstance(t, _Send) or t.state != "open":
                continue
            L = t.num_prompt_tokens
            end = min(sr.end_pos, L)
            ready = -(-L // bs) if end >= L else end // bs
            first = sr.num_computed_tokens // bs
            if self.config.granularity == "layerwise" and t.covered < min(first, ready):
                # computed before this step (hits, a recompute): every layer now
                self._queue(t, [(i, t.covered, min(first, ready), sr.block_ids)
                                for i in range(len(self.kv_caches))])
                t.covered = min(first, ready)
            self._active.append((t, t.covered, ready, sr.block_ids, end >= L))

    def _register(self, t: _Transfer, table: dict) -> None:
        with self._lock:  # a connection that came first waits for this (_serve_conn)
            table[t.transfer_id] = t
            self._by_request[t.request_id] = t
            self._lock.notify_all()

    def _queue(self, t: _Send, items: list) -> None:
        with t.cond:
            t.frames.extend(items)
            t.cond.notify()

    # ------------------------------------------------------------------ the step's hooks
    def start_load_kv(self) -> None:
        """Loads run on their own threads from registration on: nothing to start per step."""

    def wait_for_layer_load(self, layer: int) -> None:
        """No step reads a loading request's blocks: nothing to wait for."""

    def save_kv_layer(self, layer: int) -> None:
        """``layer``'s attention has written this step's KV: queue its blocks the step
        completed, for each save this step advances (``layerwise`` only)."""
        if self.config.granularity != "layerwise":
            return
        for t, b0, b1, ids, _ in self._active:
            if b1 > b0:
                self._queue(t, [(layer, b0, b1, ids)])

    @property
    def has_layer_work(self) -> bool:
        """This step advances a layer-wise save (the forward must call the layer hooks)."""
        return bool(self._active) and self.config.granularity == "layerwise"

    def wait_for_save(self) -> None:
        """After the forward: ``eager`` saves whose prompt this step ended queue every layer's
        blocks; ``layerwise`` ones note what the step's layer hooks queued."""
        if self.events is not None and self._active:
            self.events.append((time.monotonic(), "forward_end", 0))
        for t, b0, b1, ids, ends in self._active:
            if self.config.granularity == "eager":
                if ends:
                    self._queue(t, [(i, 0, b1, ids) for i in range(len(self.kv_caches))])
            t.covered = max(t.covered, b1)

    def after_sample(self, out: SchedulerOutput, sampled: list[list[int]]) -> None:
        """Queue the first token of each save whose prompt this step ended (the transfer's
        last message)."""
        for t, _, _, _, ends in self._active:
            if not ends:
                continue
            for sr, toks in zip(out.scheduled, sampled):
                if sr.request_id == t.request_id:
                    self._queue(t, [(_DONE, list(toks), t.num_prompt_tokens)])
        self._active = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's: (requests whose sending finished, requests whose receiving finished) since
        the last call (the failures stay for :meth:`build_connector_output`)."""
        sent, received = self._take_finished()
        return set(sent), {r.request_id for r in received}

    def _take_finished(self) -> tuple[list[str], list[KVReceived]]:
        with self._lock:
            out = self._finished_sending, self._finished_recving
            self._finished_sending, self._finished_recving = [], []
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of transfers that failed on this (decode) side since the last call."""
        with self._lock:
            ids, self._load_error_blocks = self._load_error_blocks, set()
        return ids

    def build_connector_output(self) -> KVConnectorOutput:
        """The finished and failed transfers since the last call, and the counters."""
        with self._lock:  # one hold: a transfer is reported finished or failed, not lost
            sent, received = self._take_finished()
            failed, self._failed = self._failed, {}
            return KVConnectorOutput(sent, received, failed, self.bytes_sent,
                                     self.bytes_received, self.failures)

    # ------------------------------------------------------------------ ends
    def _finish(self, t: _Transfer, state: str, why: str = "",
                received: KVReceived | None = None) -> None:
        """Report ``t`` once: finished (``done``), failed or cancelled."""
        with t.lock:
            if t.state != "open":
                return
            t.state = state
            seg = t.segment
        if seg is not None:  # the name goes now, the mapping when the transfer's thread stops
            seg.unlink()
        if t.sock is not None:
            try:
                t.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            t.sock.close()
        if isinstance(t, _Send):
            with t.cond:
                t.frames.clear()
                t.cond.notify_all()
        with self._lock:
            table = self._sends if isinstance(t, _Send) else self._recvs
            if table.get(t.transfer_id) is t:
                del table[t.transfer_id]
            if self._by_request.get(t.request_id) is t:
                del self._by_request[t.request_id]
            if state == "done":
                if received is not None:
                    self._finished_recving.append(received)
                else:
                    self._finished_sending.append(t.request_id)
            else:
                if state == "failed":
                    self.failures += 1
                    logger.warning("KV transfer %s of %s failed: %s", t.transfer_id,
                                   t.request_id, why)
                if isinstance(t, _Recv):
                    self._failed[t.request_id] = why
                    self._load_error_blocks.update(t.load.block_ids[t.load.first_block:])
                elif state == "cancelled":
                    self._finished_sending.append(t.request_id)
                else:
                    self._failed[t.request_id] = why
            self._lock.notify_all()
        if self.wake is not None:
            self.wake()

    def _stop(self, request_id: str, why: str) -> None:
        t = self._by_request.get(request_id)
        if t is None:  # nothing in flight here (reported already, or this worker restarted):
            with self._lock:  # say so, so that the scheduler frees what it holds for it
                self._failed[request_id] = why
            return
        self._finish(t, "cancelled", why)

    def close(self) -> None:
        """Stop listening and end every transfer (as failed)."""
        self._closed = True
        try:
            self._server.close()
        except OSError:
            pass
        for t in list(self._by_request.values()):
            self._finish(t, "failed", "the connector closed")

    # ------------------------------------------------------------------ connections
    def _deadline(self) -> float:
        return time.monotonic() + self.config.timeout_s

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(sock,), daemon=True,
                             name="sloserve-kv-conn").start()

    def _serve_conn(self, sock: socket.socket) -> None:
        """An opened connection: find its transfer (waiting up to ``timeout_s`` for this side's
        scheduler to register it), then send or receive."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.config.timeout_s)
        try:
            hello = expect(recv_msg(sock), "hello")
            tid, kind = str(hello["transfer_id"]), hello["kind"]
            table = self._recvs if kind == "push" else self._sends
            deadline = self._deadline()
            with self._lock:
                while tid not in table and time.monotonic() < deadline and not self._closed:
                    self._lock.wait(0.2)
                t = table.get(tid)
                if t is None or t.sock is not None:
                    raise TransferError(f"no transfer {tid!r} here")
                t.sock = sock
        except Exception as e:  # noqa: BLE001 - a malformed hello: refuse the connection
            try:
                send_msg(sock, {"t": "error", "message": str(e)})
            except OSError:
                pass
            sock.close()
            return
        self._run(t, sock)

    def _open_push(self, t: _Send) -> None:
        self._open(t, "push")

    def _open_pull(self, r: _Recv) -> None:
        self._open(r, "pull")

    def _open(self, t: _Transfer, kind: str) -> None:
        host, port = (t.remote if isinstance(t, _Send)
                      else (t.load.remote_host, t.load.remote_port))
        try:
            sock = connect(host, port, self._deadline())
            sock.settimeout(self.config.timeout_s)
            with t.lock:
                if t.state != "open":
                    sock.close()
                    return
                t.sock = sock
            send_msg(sock, {"t": "hello", "transfer_id": t.transfer_id, "kind": kind})
        except Exception as e:  # noqa: BLE001 - a bad address too: this transfer fails now
            self._finish(t, "failed", f"{type(e).__name__}: {e}")
            return
        self._run(t, sock)

    def _run(self, t: _Transfer, sock: socket.socket) -> None:
        try:
            if isinstance(t, _Send):
                self._send_loop(t, sock)
            else:
                self._recv_loop(t, sock)
        except Exception as e:  # noqa: BLE001 - whatever the peer sent: this transfer fails
            self._finish(t, "failed", f"{type(e).__name__}: {e}")
        finally:
            if t.segment is not None:  # this thread's mapping: no copy in or out after this
                t.segment.close()
                t.segment.unlink()

    # ------------------------------------------------------------------ sending
    def _send_loop(self, t: _Send, sock: socket.socket) -> None:
        need = expect(recv_msg(sock), "need")
        first, total = need.get("first_block"), -(-t.num_prompt_tokens // self.block_size)
        if type(first) is not int or not 0 <= first <= total:
            raise TransferError(f"a need for blocks from {first!r} of a prompt of {total}")
        seg = self._shm_segment(t, sock, need.get("host"), total - first)
        while True:
            with t.cond:
                while not t.frames and t.state == "open":
                    t.cond.wait(0.5)
                if t.state != "open":
                    return
                item = t.frames.popleft()
            if item[0] == _DONE:
                if seg is not None:  # the name must outlive D's mapping: `done` ends it
                    expect(recv_msg(sock), "mapped")
                send_msg(sock, {"t": "done", "output_token_ids": item[1],
                                "num_computed_tokens": item[2]})
                self._finish(t, "done")
                return
            layer, b0, b1, ids = item
            b0 = max(b0, first)
            if b0 >= b1:
                continue
            with t.lock:  # a cancel waits for the copy; after it the blocks may be reused
                if t.state != "open":
                    return
                data = self.backend.export_blocks(
                    self.kv_caches[layer], torch.tensor(ids[b0:b1], dtype=torch.long))
            raw = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
            if seg is None:
                send_msg(sock, {"t": "kv", "layer": layer, "b0": b0, "b1": b1,
                                "nbytes": len(raw)})
                send_payload(sock, raw, self.bucket)
            else:  # into the segment, unthrottled (the bucket models a link)
                off = (layer * (total - first) + b0 - first) * self.layer_block_bytes
                seg.buf[off:off + len(raw)] = raw
                send_msg(sock, {"t": "kv", "layer": layer, "b0": b0, "b1": b1,
                                "nbytes": len(raw), "off": off})
            with self._lock:
                self.bytes_sent += len(raw)

    def _shm_segment(self, t: _Send, sock: socket.socket, peer: object,
                     nblocks: int) -> shm.Segment | None:
        """``transport: shm`` and a receiving side on this host (``peer``: the host its
        ``need`` named, None: it offers no shared memory): a segment for the transfer's
        ``nblocks`` blocks of every layer, named to the receiving side; else None (TCP)."""
        if self.config.transport != "shm" or nblocks == 0:
            return None
        why = None
        if peer is None or peer != self.host_identity:
            why = ("offers no shared memory" if peer is None else
                   "is on another host" if self.host_identity else
                   "cannot be reached by shared memory from here (no /dev/shm)")
        else:
            try:
                seg = shm.Segment.create(len(self.kv_caches) * nblocks * self.layer_block_bytes)
            except OSError as e:
                why, peer = f"cannot be reached by shared memory: {e}", f"error {e.errno}"
        if why is not None:
            with self._lock:
                warn = peer not in self._tcp_warned
                self._tcp_warned.add(peer)
            if warn:
                logger.warning("KV transfer %s: the receiving side %s; sending over TCP "
                               "(transport shm works within one host; said once per peer)",
                               t.transfer_id, why)
            return None
        with t.lock:
            if t.state == "open":
                t.segment = seg
        if t.segment is not seg:  # ended meanwhile
            seg.close()
            seg.unlink()
            return None
        send_msg(sock, {"t": "shm", "name": seg.name, "nbytes": seg.nbytes})
        return seg

    # ------------------------------------------------------------------ receiving
    def _recv_loop(self, r: _Recv, sock: socket.socket) -> None:
        ld = r.load
        ids = torch.tensor(ld.block_ids, dtype=torch.long)
        # which blocks of each layer have arrived: all of [first_block, n) before `done`
        want = len(ld.block_ids) - ld.first_block
        got = [bytearray(want) for _ in self.kv_caches]
        need = {"t": "need", "first_block": ld.first_block}
        if self.config.transport == "shm" and self.host_identity is not None:
            need["host"] = self.host_identity  # shared memory is welcome, from this host
        send_msg(sock, need)
        while True:
            msg = recv_msg(sock)
            if msg.get("t") == "shm":
                self._attach(r, sock, msg, "host" in need,
                             len(self.kv_caches) * want * self.layer_block_bytes)
                continue
            if msg.get("t") == "done":
                n = msg.get("num_computed_tokens")
                if n != ld.num_prompt_tokens:
                    raise TransferError(f"the prefill side computed {n!r} tokens, the prompt "
                                        f"here has {ld.num_prompt_tokens}")
                toks = msg.get("output_token_ids")
                if not (isinstance(toks, list) and 1 <= len(toks) <= MAX_FIRST_TOKENS and all(
                        type(x) is int and 0 <= x < self.vocab_size for x in toks)):
                    raise TransferError(f"the first tokens must be 1 to {MAX_FIRST_TOKENS} "
                                        f"token ids below {self.vocab_size}, got "
                                        f"{str(toks)[:60]}")
                missing = sum(want - sum(g) for g in got)
                if missing:
                    raise TransferError(f"`done` with {missing} (layer, block) pieces of KV "
                                        f"missing")
                if self.events is not None:
                    self.events.append((time.monotonic(), "done", self.bytes_received))
                self._finish(r, "done", received=KVReceived(
                    r.request_id, toks, n, time.monotonic() - r.started))
                return
            expect(msg, "kv")
            layer, b0, b1, nbytes = (msg.get(k) for k in ("layer", "b0", "b1", "nbytes"))
            if not all(type(x) is int for x in (layer, b0, b1, nbytes)):
                raise TransferError(f"a KV frame header with non-integer fields: {msg}")
            if not (0 <= layer < len(self.kv_caches) and ld.first_block <= b0 < b1
                    <= len(ld.block_ids)) or nbytes != (b1 - b0) * self.layer_block_bytes:
                raise TransferError(f"a KV frame for layer {layer} blocks [{b0}, {b1}) of "
                                    f"{nbytes} bytes does not fit {len(ld.block_ids)} blocks "
                                    f"from {ld.first_block}")
            off, seg = msg.get("off"), r.segment
            if seg is None:
                if off is not None:
                    raise TransferError("a KV frame in shared memory, but no segment named")
                buf = bytearray(nbytes)
                recv_payload(sock, memoryview(buf))
                data = torch.frombuffer(buf, dtype=torch.uint8)
            else:
                if not (type(off) is int and 0 <= off <= seg.nbytes - nbytes
                        and off % self.layer_block_bytes == 0):
                    raise TransferError(f"a KV frame at offset {off!r} of {nbytes} bytes does "
                                        f"not fit the segment's {seg.nbytes}")
                data = torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes, offset=off)
            with self._lock:
                self.bytes_received += nbytes
            if self.on_receive is not None:
                if seg is None:
                    self.on_receive(buf)
                else:
                    with seg.buf[off:off + nbytes] as piece:
                        self.on_receive(piece)
            shape = list(self._shape)
            shape[self._block_dim] = b1 - b0
            data = data.view(self._dtype).view(shape)
            with r.lock:
                if r.state != "open":
                    return
                self.backend.import_blocks(self.kv_caches[layer], ids[b0:b1], data)
            got[layer][b0 - ld.first_block:b1 - ld.first_block] = b"\x01" * (b1 - b0)
            if self.events is not None:
                self.events.append((time.monotonic(), "received", self.bytes_received))

    def _attach(self, r: _Recv, sock: socket.socket, msg: dict, offered: bool,
                nbytes: int) -> None:
        """A ``shm`` message: map the segment it names (``nbytes``: the whole transfer's), then
        unlink its name at once (if either side dies now, nothing is left in /dev/shm)."""
        name, size = msg.get("name"), msg.get("nbytes")
        if not offered or r.segment is not None:
            raise TransferError("a shm message unasked for" if not offered else
                                "a second shm message")
        if not shm.valid_name(name) or type(size) is not int or size != nbytes:
            raise TransferError(f"a shm message naming {str(name)[:80]!r} of {size!r} bytes: "
                                f"expected a {shm.PREFIX}* segment of {nbytes} bytes")
        seg = shm.Segment.attach(name, nbytes)
        seg.unlink()
        with r.lock:
            r.segment = seg  # _run's end unmaps it
        send_msg(sock, {"t": "mapped"})  # the prefill side may end the transfer now
