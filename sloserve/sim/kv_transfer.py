"""Prefill/decode disaggregation: how long the KV hand-off keeps a request from decoding.

A disaggregated deployment (DistServe, Zhong et al. OSDI'24, section 3; Splitwise) prefills on
prefill instances and decodes on decode instances; the prompt's KV cache crosses a link in
between. The time it adds after the prefill ends ("exposed") comes from the roofline
calculator's link model (:func:`sloserve.roofline.bounds.kv_transfer`):

* ``eager``: the whole KV is sent after the prefill: ``latency + bytes / bandwidth``;
* ``layerwise``: layer l's KV is sent while layers l+1.. compute, so only what the pipeline
  cannot hide is exposed: ``latency + max(0, finish - prefill)`` with
  ``finish = c + x + (L - 1) * max(c, x)``, c and x the per-layer compute and transfer times.

The prefill time a request's KV was produced over is taken from its first scheduled step to the
end of its last prefill step on the prefill instance (a chunked prompt is produced over several
steps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sloserve.roofline.bounds import kv_transfer

MODES = ("eager", "layerwise")


@dataclass(frozen=True)
class KVTransferModel:
    """The link between prefill and decode instances.

    Attributes:
        kv_bytes_per_token: KV bytes of one token over all layers (bytes).
        bandwidth: link bytes/s in one direction.
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
        ``num_tokens`` tokens produced over ``prefill_s`` seconds."""
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
