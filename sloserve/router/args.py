"""``sloserve router``'s flags (the names vllm-router / sglang-router use where they have one)
and the :class:`~sloserve.router.config.RouterConfig` they make. Imports nothing heavy: the
CLI builds this parser at every start."""
from __future__ import annotations

import argparse

_POLICIES = ("round-robin", "least-outstanding", "prefix-aware")


def add_router_args(p: argparse.ArgumentParser) -> None:
    from sloserve.argtypes import port, pos_int
    from sloserve.config import DEFAULT_MAX_BODY_BYTES
    from sloserve.slo import add_goodput_arg

    w = p.add_argument_group("workers")
    w.add_argument("--replicas", nargs="+", default=[], metavar="URL",
                   help="interchangeable OpenAI servers (sloserve or vLLM), e.g. "
                        "http://10.0.0.1:8000")
    w.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill servers of disaggregated serving (with --decode)")
    w.add_argument("--decode", nargs="+", default=[], metavar="URL",
                   help="decode servers of disaggregated serving (with --prefill)")
    r = p.add_argument_group("routing")
    r.add_argument("--routing-policy", choices=_POLICIES, default=None,
                   help="how a replica (or a prefill server) is chosen: in turn, fewest "
                        "requests in flight, or the longest prefix cached per the workers' KV "
                        "events traded against load (default: prefix-aware with "
                        "--kv-events-config, else least-outstanding); decode servers are "
                        "chosen least-outstanding")
    r.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="the workers' --kv-events-config (vLLM's JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}'): "
                        "the router subscribes at each worker's host and the endpoint's port, "
                        "on its topic (a replay_endpoint likewise)")
    r.add_argument("--kv-events-endpoints", nargs="+", default=[], metavar="ENDPOINT",
                   help="each replica's (prefill server's) KV event endpoint, in the order of "
                        "--replicas (--prefill), e.g. tcp://10.0.0.1:5557; overrides the ones "
                        "--kv-events-config implies")
    r.add_argument("--cache-threshold", type=float, default=0.3, metavar="F",
                   help="prefix-aware: the longest cached prefix wins when it covers more than "
                        "this fraction of the prompt's tokens, else least-outstanding "
                        "(default 0.3)")
    r.add_argument("--balance-abs-threshold", type=int, default=64, metavar="N",
                   help="prefix-aware: the load is imbalanced (least-outstanding, the cache "
                        "ignored) when the most and fewest outstanding requests differ by more "
                        "than N ... (default 64)")
    r.add_argument("--balance-rel-threshold", type=float, default=1.5, metavar="F",
                   help="... and the most exceeds F times the fewest (default 1.5)")
    r.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="prefix-aware: tokens per KV block to hash prompts with until a "
                        "worker's events name its own (default 16)")
    r.add_argument("--speculative-ttl", type=float, default=2.0, metavar="S",
                   help="prefix-aware: seconds a routed prompt's blocks count as cached on its "
                        "replica before its events say so, so a burst of one new prefix goes "
                        "to one replica (default 2; 0: off)")
    r.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="prefix-aware: tokenize prompts here with this model's tokenizer "
                        "(GGUF file or Hugging Face folder) rather than with a worker's "
                        "POST /tokenize")
    d = p.add_argument_group("disaggregated serving")
    d.add_argument("--kv-transfer-flow", choices=("concurrent", "serial"), default="concurrent",
                   help="concurrent: both halves at once, joined by a transfer id (SGLang's "
                        "bootstrap; layer-wise push); serial: prefill first, its "
                        "kv_transfer_params to the decode server (vLLM's proxy)")
    h = p.add_argument_group("health and serving")
    h.add_argument("--health-check-interval", type=float, default=0.5, metavar="S",
                   help="seconds between /health polls of a worker (default 0.5)")
    h.add_argument("--health-check-timeout", type=float, default=1.0, metavar="S",
                   help="a poll that takes longer marks the worker down: its requests in "
                        "flight fail, new ones avoid it until /health answers 200 again "
                        "(default 1)")
    h.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                   help="seconds to open a connection to a worker (default 5)")
    h.add_argument("--max-request-body-bytes", type=pos_int, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="N", help="larger request bodies get HTTP 413 in the API's error "
                                     "shape before they are read or forwarded (default "
                                     f"{DEFAULT_MAX_BODY_BYTES}, the servers' own)")
    add_goodput_arg(h, "; the router judges each completion / chat request as its client sees "
                       "it and counts sloserve:requests_slo_met_total and "
                       "sloserve:requests_slo_missed_total{reason} on its /metrics")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=port, default=8080)
    h.add_argument("--log-level", default="info")


def config_from_args(a: argparse.Namespace):
    """The :class:`RouterConfig` of parsed flags. Raises ValueError naming a bad flag."""
    from sloserve.router.config import RouterConfig
    from sloserve.slo import parse_goodput

    return RouterConfig(
        replicas=a.replicas, prefill=a.prefill, decode=a.decode,
        routing_policy=a.routing_policy, kv_events_config=a.kv_events_config,
        kv_events_endpoints=a.kv_events_endpoints, cache_threshold=a.cache_threshold,
        balance_abs_threshold=a.balance_abs_threshold,
        balance_rel_threshold=a.balance_rel_threshold, block_size=a.block_size,
        speculative_ttl=a.speculative_ttl, tokenizer=a.tokenizer,
        kv_transfer_flow=a.kv_transfer_flow, health_check_interval=a.health_check_interval,
        health_check_timeout=a.health_check_timeout, connect_timeout=a.connect_timeout,
        max_request_body_bytes=a.max_request_body_bytes, goodput=parse_goodput(a.goodput),
        host=a.host, port=a.port, log_level=a.log_level).validate()


def router_parser() -> argparse.ArgumentParser:
    """A parser of the router's flags alone (``sloserve cluster`` and data-parallel ``serve``
    build the router's command line)."""
    p = argparse.ArgumentParser(prog="sloserve router", allow_abbrev=False)
    add_router_args(p)
    return p
