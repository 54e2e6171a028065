"""The router's settings (``sloserve router`` flags; see ``args``), checked."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sloserve.config import DEFAULT_MAX_BODY_BYTES
from sloserve.engine.kv_events import KVEventsConfig

POLICIES = ("round-robin", "least-outstanding", "prefix-aware")
FLOWS = ("concurrent", "serial")

#: vllm-router's / sglang-router's cache_aware defaults
DEFAULT_CACHE_THRESHOLD = 0.3
DEFAULT_BALANCE_ABS_THRESHOLD = 64
DEFAULT_BALANCE_REL_THRESHOLD = 1.5


@dataclass
class RouterConfig:
    """What ``sloserve router`` runs (see docs/router.md).

    Attributes:
        replicas: base URLs of interchangeable OpenAI servers; or, for disaggregated serving,
        prefill, decode: base URLs of the prefill and decode servers.
        routing_policy: how a replica (or a prefill server) is chosen; None: prefix-aware
            when KV events are configured, else least-outstanding. Decode servers are always
            chosen least-outstanding.
        kv_events_config: the workers' ``--kv-events-config`` (vLLM's JSON): the router
            subscribes to each replica (prefill server) at its URL's host and the endpoint's
            port, on the config's topic; a replay endpoint likewise.
        kv_events_endpoints: explicit SUB endpoints, one per replica (prefill server), in
            order; overrides the ones derived from kv_events_config.
        cache_threshold, balance_abs_threshold, balance_rel_threshold: prefix-aware's
            trade-off (sglang-router's cache_aware): while the load is balanced the replica
            with the longest cached prefix gets the request if it covers more than
            ``cache_threshold`` of the prompt, else the least-outstanding one; the load is
            imbalanced (least-outstanding, cache ignored) when max - min outstanding >
            ``balance_abs_threshold`` and max > ``balance_rel_threshold`` * min.
        block_size: tokens per KV block, to hash prompts until a replica's events give its own.
        speculative_ttl: seconds a routed prompt's blocks count as cached on the chosen
            replica before its events arrive (0: off), so a burst of one prefix is not spread.
        tokenizer: a model path whose tokenizer hashes prompts here; None: each prompt is
            tokenized by a replica's ``POST /tokenize``.
        kv_transfer_flow: ``concurrent`` (both halves at once, SGLang's bootstrap) or
            ``serial`` (prefill first, vLLM's proxy).
        health_check_interval, health_check_timeout: seconds between a worker's ``/health``
            polls, and a poll's limit; a worker that cannot be reached is marked down at once.
        connect_timeout: seconds to open a connection to a worker for a request.
        max_request_body_bytes: larger request bodies get 413 before they are read or
            forwarded (the servers' own limit and default).
        goodput: the per-request SLO (``sloserve.slo``, ms limits by metric) the router judges
            each completion / chat request by, as its client sees it (``router.timing``).
    """

    replicas: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    routing_policy: str | None = None
    kv_events_config: KVEventsConfig | None = None
    kv_events_endpoints: list[str] = field(default_factory=list)
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD
    block_size: int = 16
    speculative_ttl: float = 2.0
    tokenizer: str | None = None
    kv_transfer_flow: str = "concurrent"
    health_check_interval: float = 0.5
    health_check_timeout: float = 1.0
    connect_timeout: float = 5.0
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
    goodput: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replicas = [normalize_url(u) for u in self.replicas]
        self.prefill = [normalize_url(u) for u in self.prefill]
        self.decode = [normalize_url(u) for u in self.decode]
        if isinstance(self.kv_events_config, (str, dict)):
            self.kv_events_config = KVEventsConfig.of(self.kv_events_config)

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def policy(self) -> str:
        """The routing policy in force (the default resolved)."""
        if self.routing_policy is not None:
            return self.routing_policy
        return "prefix-aware" if self.events_wanted else "least-outstanding"

    @property
    def events_wanted(self) -> bool:
        return self.kv_events_config is not None or bool(self.kv_events_endpoints)

    @property
    def routed(self) -> list[str]:
        """The URLs the policy chooses among (replicas, or the prefill servers)."""
        return self.prefill if self.disaggregated else self.replicas

    def validate(self) -> "RouterConfig":
        """Raises ValueError naming the flag."""
        if self.replicas and self.disaggregated:
            raise ValueError("give --replicas, or --prefill and --decode, not both")
        if not self.replicas and not self.disaggregated:
            raise ValueError("give --replicas URL..., or --prefill URL... --decode URL...")
        if self.disaggregated and not (self.prefill and self.decode):
            raise ValueError("--prefill and --decode go together (each at least one URL)")
        for urls in (self.replicas, self.prefill, self.decode):
            if len(set(urls)) != len(urls):
                raise ValueError(f"a worker URL is given twice: {urls}")
        if set(self.prefill) & set(self.decode):
            raise ValueError("a worker cannot be both a prefill and a decode server")
        if self.routing_policy is not None and self.routing_policy not in POLICIES:
            raise ValueError(f"--routing-policy must be one of {', '.join(POLICIES)}")
        if self.policy == "prefix-aware" and not self.events_wanted:
            raise ValueError("--routing-policy prefix-aware reads the workers' KV cache events: "
                             "give --kv-events-config (or --kv-events-endpoints)")
        if self.kv_events_endpoints and len(self.kv_events_endpoints) != len(self.routed):
            raise ValueError(f"--kv-events-endpoints needs one endpoint per "
                             f"{'prefill server' if self.disaggregated else 'replica'} "
                             f"({len(self.routed)}), got {len(self.kv_events_endpoints)}")
        eps = [e for e, _ in self.events_endpoints()]  # raises for one it cannot derive
        if len(set(eps)) != len(eps):
            raise ValueError(f"the workers' KV event endpoints are not distinct ({eps}): "
                             f"give one per worker with --kv-events-endpoints")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and "
                             "--balance-rel-threshold >= 1")
        if self.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if self.kv_transfer_flow not in FLOWS:
            raise ValueError(f"--kv-transfer-flow must be one of {', '.join(FLOWS)}")
        for name in ("health_check_interval", "health_check_timeout", "connect_timeout"):
            v = getattr(self, name)
            if not 0 < v < 86400:  # NaN too
                raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds in "
                                 f"(0, 86400), got {v}")
        if self.kv_transfer_flow != "concurrent" and not self.disaggregated:
            raise ValueError("--kv-transfer-flow applies to --prefill/--decode, not --replicas")
        if self.speculative_ttl < 0:
            raise ValueError("--speculative-ttl must be >= 0")
        return self

    def events_endpoints(self) -> list[tuple[str, str | None]]:
        """Per routed worker (in order), its KV event SUB endpoint and replay endpoint."""
        if self.kv_events_endpoints:
            return [(e, None) for e in self.kv_events_endpoints]
        cfg = self.kv_events_config
        if cfg is None:
            return []
        return [(events_endpoint(cfg.endpoint, url),
                 events_endpoint(cfg.replay_endpoint, url) if cfg.replay_endpoint else None)
                for url in self.routed]


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` as ``http://host:port``.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    u = url.strip().rstrip("/")
    if "://" not in u:
        u = "http://" + u
    parts = urlsplit(u)
    try:
        port = parts.port  # raises for a port that is not a number in 0-65535
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 \
            or port == 0 or parts.path or parts.query or '"' in u:
        raise ValueError(f"not a worker URL (http://host:port): {url!r}")
    return u


def events_endpoint(endpoint: str, worker_url: str) -> str:
    """Where to reach a worker's KV event socket, from its ``--kv-events-config`` endpoint: a
    wildcard host (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) becomes the worker URL's host;
    any other endpoint is used as it is.

    Raises:
        ValueError: an ipc:// or inproc:// endpoint for a worker on another host.
    """
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", "::", ""):
            whost = urlsplit(worker_url).hostname or "127.0.0.1"
            if ":" in whost:
                whost = f"[{whost}]"
            return f"tcp://{whost}:{port}"
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        host = urlsplit(worker_url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"KV events endpoint {endpoint} is local to its host; worker "
                             f"{worker_url} is not on this one (give --kv-events-endpoints)")
        return endpoint
    raise ValueError(f"unsupported KV events endpoint {endpoint!r} (tcp://, ipc://)")
