"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own:

    sloserve_router_requests_total{worker,role}             requests sent to each worker
    sloserve_router_outstanding_requests{worker,role}       requests in flight on each worker
    sloserve_router_worker_healthy{worker,role}             1 while it takes new requests
    sloserve_router_worker_state{worker,role,state}         1 for its state (healthy,
                                                            unhealthy, down, unknown)
    sloserve_router_proxy_errors_total{worker,reason}       requests a worker failed: connect,
                                                            worker_down, reset, prefill_failed,
                                                            bad_response ("" worker: no_worker)
    sloserve_router_routing_decisions_total{policy,decision}  why each worker was chosen
    sloserve_router_prefix_hit_tokens_total                 prompt tokens the chosen replica
                                                            held, per its KV events
    sloserve_router_prefix_query_tokens_total               prompt tokens looked up
    sloserve:requests_slo_met_total, sloserve:requests_slo_missed_total{reason}
                                                            completion / chat requests judged
                                                            by ``--goodput`` as the client
                                                            sees them (``router.timing``;
                                                            serve's names and rule)
    sloserve:stats_sequence                                 requests recorded (``/stats`` seq)

``snapshot`` is the router's ``GET /stats``: the same shape as a server's (``sloserve.stats``),
its window over the requests the router timed.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app

from sloserve.router.workers import DOWN, HEALTHY, UNHEALTHY, UNKNOWN
from sloserve.slo import SLO_METRICS, missed_slo
from sloserve.stats import LatencyWindow, registry_values

STATES = (HEALTHY, UNHEALTHY, DOWN, UNKNOWN)


class RouterMetrics:
    """Args:
        slos: the per-request SLO limits in ms (``sloserve.slo``; empty: none judged)."""

    def __init__(self, slos: dict[str, float] | None = None):
        self.slos = dict(slos or {})
        self.window = LatencyWindow()
        self.window.start(time.monotonic())  # goodput over the router's time up, to a minute
        self.seq = 0
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sloserve_router_requests", "requests sent to each worker",
                                ["worker", "role"], registry=r)
        self.outstanding = Gauge("sloserve_router_outstanding_requests",
                                 "requests in flight on each worker", ["worker", "role"],
                                 registry=r)
        self.healthy = Gauge("sloserve_router_worker_healthy",
                             "1 while the worker takes new requests", ["worker", "role"],
                             registry=r)
        self.state = Gauge("sloserve_router_worker_state", "1 for the worker's state",
                           ["worker", "role", "state"], registry=r)
        self.errors = Counter("sloserve_router_proxy_errors",
                              "requests that failed at a worker, by reason",
                              ["worker", "reason"], registry=r)
        self.decisions = Counter("sloserve_router_routing_decisions",
                                 "routing decisions by policy and reason",
                                 ["policy", "decision"], registry=r)
        self.hit_tokens = Counter("sloserve_router_prefix_hit_tokens",
                                  "prompt tokens cached on the chosen replica (KV events)",
                                  registry=r)
        self.query_tokens = Counter("sloserve_router_prefix_query_tokens",
                                    "prompt tokens looked up in the replicas' KV events",
                                    registry=r)
        self.slo_met = Counter("sloserve:requests_slo_met",
                               "requests that met every --goodput limit, as the client saw them",
                               registry=r)
        missed = Counter("sloserve:requests_slo_missed",
                         "requests over a --goodput limit (the first one missed)", ["reason"],
                         registry=r)
        self.slo_missed = {m: missed.labels(m) for m in SLO_METRICS if m in self.slos}
        self.g_seq = Gauge("sloserve:stats_sequence", "requests recorded (GET /stats's seq)",
                           registry=r)

    def record_request(self, ttft: float, tpot: float | None, e2e: float, itls) -> None:
        """A request that finished (``router.timing``), times in seconds."""
        now = time.monotonic()
        missed = None
        if self.slos:
            missed = missed_slo(self.slos, ttft, tpot, e2e) or ""
            if missed:
                self.slo_missed[missed].inc()
            else:
                self.slo_met.inc()
        self.window.add_itls(now, itls)
        self.window.add_request(now, ttft, tpot, e2e, missed)
        self.seq += 1
        self.g_seq.set(self.seq)

    def request_sent(self, w) -> None:
        self.requests.labels(w.url, w.role).inc()

    def proxy_error(self, w, reason: str) -> None:
        self.errors.labels(w.url if w is not None else "", reason).inc()

    def decision(self, policy: str, decision: str) -> None:
        self.decisions.labels(policy, decision).inc()

    def prefix_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens.inc(query_tokens)
        self.hit_tokens.inc(hit_tokens)

    def render(self, workers) -> bytes:
        """The exposition text, the per-worker gauges read now."""
        self._refresh(workers)
        return generate_latest(self.registry)

    def _refresh(self, workers) -> None:
        for w in workers:
            self.outstanding.labels(w.url, w.role).set(w.outstanding)
            self.healthy.labels(w.url, w.role).set(1 if w.available else 0)
            for s in STATES:
                self.state.labels(w.url, w.role, s).set(1 if w.state == s else 0)

    def snapshot(self, workers) -> dict:
        """The router's own ``GET /stats`` fields (the per-worker gauges read now)."""
        self._refresh(workers)
        return {"object": "stats", "seq": self.seq, "time": time.time(), "slo_ms": self.slos,
                "cumulative": registry_values(self.registry),
                "window": self.window.summary(time.monotonic())}
