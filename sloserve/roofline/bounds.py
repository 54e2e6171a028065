"""Lower bounds on latency and capacity, from the roofline and the KV formulas.

- Decode step time >= bytes moved / (bandwidth x efficiency): a decode step must stream every
  weight byte and the batch's KV cache at least once (memory-bound regime).
- Prefill time >= FLOPs / (peak x efficiency) (compute-bound regime); in general a step takes
  at least ``max(FLOPs / (peak x e_c), bytes / (bandwidth x e_m))``.
- TPOT (time per output token) >= the decode step bound; a user sees <= 1 / TPOT tokens/s, the
  engine produces <= batch / TPOT tokens/s.
- Max batch = floor((memory budget - weights - reserve) / KV bytes per sequence), per GPU
  (vLLM's ``gpu_memory_utilization`` sizing, Kwon et al. 2023).
- KV transfer for prefill/decode disaggregation (DistServe, Zhong et al., OSDI 2024;
  Splitwise, Patel et al., ISCA 2024): eager = send after prefill, exposed ``X = bytes / link``;
  layer-wise pipelined = send layer i while layer i+1 computes. With per-layer compute
  ``c = P / L`` and per-layer transfer ``x = X / L``, the last byte lands at
  ``c + x + (L - 1) max(c, x)``, so the time exposed after prefill is ``x`` when ``x <= c``
  and ``X - P + c`` otherwise.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def decode_step_time(bytes_moved: float, bandwidth: float, efficiency: float = 1.0) -> float:
    """Seconds >= ``bytes_moved / (bandwidth x efficiency)``."""
    return bytes_moved / (bandwidth * efficiency)


def prefill_time(flops: float, peak: float, efficiency: float = 1.0) -> float:
    """Seconds >= ``flops / (peak x efficiency)``."""
    return flops / (peak * efficiency)


def step_time(flops: float, bytes_moved: float, peak: float, bandwidth: float,
              compute_efficiency: float = 1.0, memory_efficiency: float = 1.0) -> float:
    """Seconds >= ``max(flops / (peak e_c), bytes / (bandwidth e_m))``."""
    return max(prefill_time(flops, peak, compute_efficiency),
               decode_step_time(bytes_moved, bandwidth, memory_efficiency))


@dataclass(frozen=True)
class DecodeBound:
    """TPOT (s) and the token rates it allows: per user (tokens/s) and for the batch (tokens/s)."""

    tpot: float
    user_tokens_per_s: float
    batch_tokens_per_s: float


def decode_bound(step_seconds: float, batch: int) -> DecodeBound:
    return DecodeBound(step_seconds, 1.0 / step_seconds, batch / step_seconds)


def max_batch(memory_budget: float, weight_bytes: float, kv_bytes_per_seq: float,
              reserve_bytes: float = 0.0) -> int:
    """Largest batch whose KV fits: ``floor((budget - weights - reserve) / kv_per_seq)``, >= 0."""
    free = memory_budget - weight_bytes - reserve_bytes
    return max(0, math.floor(free / kv_bytes_per_seq)) if kv_bytes_per_seq > 0 else 0


@dataclass(frozen=True)
class KVTransfer:
    """KV hand-off from a prefill to a decode instance. Bytes and seconds.

    ``*_exposed``: time after the prefill finishes until the decode side has all of the KV.
    """

    kv_bytes: float
    link_bandwidth: float
    prefill_seconds: float
    layers: int
    transfer_seconds: float
    eager_exposed: float
    pipelined_exposed: float

    def to_dict(self) -> dict:
        return asdict(self)


def kv_transfer(kv_bytes: float, link_bandwidth: float, prefill_seconds: float,
                layers: int) -> KVTransfer:
    """Eager vs layer-wise pipelined KV transfer (see module docstring)."""
    X = kv_bytes / link_bandwidth
    c, x = prefill_seconds / layers, X / layers
    finish = c + x + (layers - 1) * max(c, x)
    return KVTransfer(kv_bytes, link_bandwidth, prefill_seconds, layers, X, X,
                      max(0.0, finish - prefill_seconds))
