"""Prefill/decode disaggregation: the KV hand-off between prefill and decode instances.

A disaggregated deployment (DistServe, Zhong et al. OSDI'24, section 3; Splitwise) prefills on
prefill instances and decodes on decode instances; the prompt's KV cache crosses a link in
between. What one transfer alone exposes after the prefill comes from the roofline calculator's
link model (:func:`sloserve.roofline.bounds.kv_transfer`, :meth:`KVTransferModel.exposed_s`):

* ``eager``: the whole KV is sent after the prefill: ``latency + bytes / bandwidth``;
* ``layerwise``: layer l's KV is sent while layers l+1.. compute, so only what the pipeline
  cannot hide is exposed: ``latency + max(0, finish - prefill)`` with
  ``finish = c + x + (L - 1) * max(c, x)``, c and x the per-layer compute and transfer times.

In a run, transfers share the link (:class:`KVNetwork`). The deployment is one NIC per
instance's host, full duplex at the link's ``bandwidth`` each way (under tensor parallelism one
per GPU, each carrying its GPU's share of every transfer, as ``sloserve sim`` splits the KV
over ``--tp``: an instance then behaves as one NIC). So it is neither one link per (P, D) pair
nor one link for all: a transfer from prefill instance p to decode instance d crosses p's NIC
out and d's NIC in, and the transfers on a NIC share it by processor sharing, max-min fair
over both ends (the fluid model of concurrent flows): two prompts that leave one prefill
instance at once each take twice as long as one alone, and so do two that go to one decode
instance; p0 -> d0 and p1 -> d1 do not meet. ``latency_s`` is added once per transfer, after
its last byte has left.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

from sloserve.roofline.bounds import kv_transfer

MODES = ("eager", "layerwise")


@dataclass(frozen=True)
class KVTransferModel:
    """The link between prefill and decode instances.

    Attributes:
        kv_bytes_per_token: KV bytes of one token over all layers (bytes).
        bandwidth: link bytes/s in one direction (of one instance's NIC).
        num_layers: layers the KV is produced in (for ``layerwise``).
        mode: ``eager`` or ``layerwise``.
        latency_s: fixed cost per transfer (s).

    Raises:
        ValueError: a non-positive size, bandwidth or layer count, a negative latency, an
            unknown mode.
    """

    kv_bytes_per_token: float
    bandwidth: float
    num_layers: int
    mode: str = "layerwise"
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.kv_bytes_per_token < math.inf and 0 < self.bandwidth < math.inf
                and self.num_layers >= 1):
            raise ValueError("kv_bytes_per_token, bandwidth and num_layers must be finite and > 0")
        if not 0 <= self.latency_s < math.inf:
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {self.latency_s}")
        if self.mode not in MODES:
            raise ValueError(f"KV transfer mode must be one of {MODES}, got {self.mode!r}")

    def exposed_s(self, num_tokens: int, prefill_s: float) -> float:
        """Seconds from the prefill's end until the decode instance holds the KV of
        ``num_tokens`` tokens produced over ``prefill_s`` seconds, the transfer alone on the
        link (what :class:`KVNetwork` gives a transfer that meets no other)."""
        t = kv_transfer(num_tokens * self.kv_bytes_per_token, self.bandwidth, max(prefill_s, 0.0),
                        self.num_layers)
        return self.latency_s + (t.eager_exposed if self.mode == "eager" else t.pipelined_exposed)


@dataclass(frozen=True)
class Disaggregation:
    """P prefill instances and D decode instances joined by ``link``.

    Raises:
        ValueError: fewer than one instance of either kind.
    """

    num_prefill: int
    num_decode: int
    link: KVTransferModel

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"need >= 1 prefill and >= 1 decode instance, got "
                             f"{self.num_prefill} and {self.num_decode}")


@dataclass(eq=False)
class _Transfer:
    """One request's KV on its way: bytes made sendable over time (``plan``), bytes sent."""

    src: int                   # NIC index: prefill instance p -> p
    dst: int                   # NIC index: decode instance d -> num_prefill + d
    eps: float                 # bytes below which a backlog counts as empty
    num_tokens: int            # the prompt whose KV crosses
    planned_tokens: int = 0    # tokens whose KV production is planned
    done: float = 0.0          # bytes of finished production segments
    ready: float = 0.0         # bytes sendable now (done + the running segments' share)
    sent: float = 0.0
    rate: float = 0.0          # bytes/s it gets now
    closed: bool = False       # the prefill ended: nothing more will be planned
    #: production to come or under way: [start, end, bytes], sendable linearly over
    #: [start, end] (start == end: all at once), in time order
    plan: list[list[float]] = field(default_factory=list)

    def production_rate(self, t: float) -> float:
        return sum(b / (t1 - t0) for t0, t1, b in self.plan if t0 <= t < t1)


class KVNetwork:
    """The transfers of a run on the instances' NICs (see the module docstring): each NIC
    carries ``link.bandwidth`` bytes/s each way, shared max-min fairly (progressive filling)
    by the transfers that have bytes to send. A transfer's bytes become sendable as its KV is
    produced: ``eager``, all at once when the prefill ends; ``layerwise``, each prefill step's
    chunk layer by layer, as a fluid: layers 1..L-1 over the step from the end of its first
    layer's compute, the last layer at the step's end (for a transfer alone on the link this
    is :meth:`KVTransferModel.exposed_s` exactly; a transfer whose bytes are all sent waits
    for more, taking only the rate they are produced at).

    Times are the simulation's seconds; the network moves only forward (:meth:`advance`), and
    :meth:`next_time` says when it next changes on its own (a transfer has sent its last byte,
    a backlog drains, production starts or stops).
    """

    #: a backlog under this fraction of its transfer's bytes is empty (float rounding)
    EPS = 1e-9

    def __init__(self, dis: Disaggregation):
        self.link, self.num_prefill = dis.link, dis.num_prefill
        self.num_nics = dis.num_prefill + dis.num_decode
        self.now = 0.0
        self.transfers: dict[Hashable, _Transfer] = {}
        self._next = math.inf
        self._sent: list[tuple[Hashable, float]] = []  # finished, not yet returned by advance

    def start(self, key: Hashable, src: int, dst: int, num_tokens: int) -> None:
        """A transfer ``key`` of ``num_tokens`` tokens' KV from prefill instance ``src`` to
        decode instance ``dst`` (indices among their kind), nothing sendable yet."""
        eps = self.EPS * num_tokens * self.link.kv_bytes_per_token
        self.transfers[key] = _Transfer(src, self.num_prefill + dst, eps, num_tokens)

    def produced(self, key: Hashable, before: int, after: int, start: float, end: float) -> None:
        """A prefill step over [start, end] (s, start = now) computed ``key``'s positions
        [before, after): ``layerwise`` makes the KV of the positions it has not planned yet
        sendable layer by layer (class docstring), and positions below ``before`` at once
        (prefix-cache hits: sent from the prefill's start; a recomputed position after a
        preemption is not sent twice); ``eager`` sends nothing before :meth:`prefill_done`."""
        f = self.transfers[key]
        if self.link.mode != "layerwise":
            return
        bpt, layers = self.link.kv_bytes_per_token, self.link.num_layers
        cached = min(before, f.num_tokens) - f.planned_tokens
        if cached > 0:
            f.plan.append([start, start, cached * bpt])
            f.planned_tokens += cached
        new = min(after, f.num_tokens) - f.planned_tokens
        if new > 0:
            if layers > 1:
                first = start + (end - start) / layers  # the first layer's compute ends
                f.plan.append([first, end, new * bpt * (layers - 1) / layers])
            f.plan.append([end, end, new * bpt / layers])
            f.planned_tokens += new
        self._move(self.now)  # what is sendable at once
        self._settle()

    def prefill_done(self, key: Hashable) -> None:
        """``key``'s prefill ended now: the rest of its KV is sendable (``eager``: all of it)."""
        f = self.transfers[key]
        rest = f.num_tokens - f.planned_tokens
        f.planned_tokens, f.closed = f.num_tokens, True
        if rest > 0:
            f.plan.append([self.now, self.now, rest * self.link.kv_bytes_per_token])
        self._move(self.now)
        self._settle()

    def next_time(self) -> float:
        """When the network next changes by itself (inf: never, until told more)."""
        return self._next

    def advance(self, t: float) -> list[tuple[Hashable, float]]:
        """Move to ``t`` (>= now); returns (key, time) of each transfer that sent its last byte
        on the way, in time order (its KV is at the decode instance ``latency_s`` later)."""
        if t < self.now:
            raise ValueError(f"the KV network cannot go back from {self.now!r} to {t!r} s")
        while self._next <= t:
            self._move(self._next)
            self._settle()
        self._move(t)
        self._settle()
        sent, self._sent = self._sent, []
        return sent

    # ------------------------------------------------------------------ the fluid
    def _move(self, t: float) -> None:
        """Send and produce at the current rates until ``t`` (no change of rates before it)."""
        dt = t - self.now
        for f in self.transfers.values():
            f.sent += f.rate * dt
            keep = []
            partial = 0.0
            for seg in f.plan:
                t0, t1, b = seg
                if t1 <= t:
                    f.done += b
                else:
                    keep.append(seg)
                    if t0 < t:
                        partial += b * (t - t0) / (t1 - t0)
            f.plan = keep
            f.ready = f.done + partial
            f.sent = min(f.sent, f.ready)
        self.now = t

    def _settle(self) -> None:
        """Finish the transfers that have sent everything, share the NICs anew, find the next
        change."""
        while True:
            for key, f in list(self.transfers.items()):
                if f.ready - f.sent <= f.eps:
                    f.sent = f.ready
                    if f.closed and not f.plan:
                        del self.transfers[key]
                        self._sent.append((key, self.now))
            self._share()
            stuck = self._find_next()
            if not stuck:
                return
            for f in stuck:  # a backlog too small to move the clock: it is sent
                f.sent = f.ready

    def _share(self) -> None:
        """Max-min fair rates by progressive filling: a transfer with a backlog wants any rate,
        one without wants the rate its KV is produced at (0: it takes none)."""
        want: dict[_Transfer, float] = {}
        for f in self.transfers.values():
            f.rate = 0.0
            w = math.inf if f.ready - f.sent > 0 else f.production_rate(self.now)
            if w > 0:
                want[f] = w
        left = [self.link.bandwidth] * self.num_nics
        users = [0] * self.num_nics
        for f in want:
            users[f.src] += 1
            users[f.dst] += 1
        while want:
            share, nic = min((left[n] / users[n], n) for n in range(self.num_nics) if users[n])
            low = min(want.values())
            fixed = [f for f, w in want.items() if w == low] if low < share else \
                [f for f in want if nic in (f.src, f.dst)]
            for f in fixed:
                f.rate = low if low < share else share
                del want[f]
                for n in (f.src, f.dst):
                    left[n] = max(0.0, left[n] - f.rate)
                    users[n] -= 1

    def _find_next(self) -> list[_Transfer]:
        """Set the time of the next change; returns the transfers whose backlog would drain
        without the clock moving (they are sent now)."""
        nxt, stuck = math.inf, []
        for f in self.transfers.values():
            for t0, t1, _ in f.plan:
                nxt = min(nxt, t0 if t0 > self.now else t1)
            backlog = f.ready - f.sent
            if backlog > 0:
                net = f.rate - f.production_rate(self.now)
                if net > 0:
                    te = self.now + backlog / net
                    if te <= self.now:
                        stuck.append(f)
                    nxt = min(nxt, te)
        self._next = nxt
        return stuck
