"""Request arrival processes: Poisson, gamma (bursty), constant rate, all at once.

The inter-arrival gap of the gamma process has shape k = ``burstiness`` and scale
1 / (rate * k), so its mean is 1 / rate for every k and its coefficient of variation is
1 / sqrt(k): k = 1 is a Poisson process, k < 1 burstier, k > 1 smoother (the same
parametrisation as ``vllm bench serve --burstiness``).
"""
from __future__ import annotations

import math
from enum import Enum

import numpy as np


class ArrivalProcess(str, Enum):
    """Shape of the inter-arrival gaps."""

    POISSON = "poisson"
    GAMMA = "gamma"
    CONSTANT = "constant"


def arrival_times(n: int, request_rate: float, *, process: ArrivalProcess | str = "poisson",
                  burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times of ``n`` requests, seconds after the start; the first is at 0.

    Args:
        n: number of requests (>= 0).
        request_rate: mean requests per second (> 0); ``inf`` sends every request at time 0.
        process: ``poisson`` (gamma with k = 1, ``burstiness`` ignored), ``gamma`` (shape
            ``burstiness``) or ``constant`` (gaps of exactly 1 / rate).
        burstiness: gamma shape k > 0 (coefficient of variation of the gaps = 1 / sqrt(k)).
        seed: seed of the numpy generator; the same seed gives the same times.

    Returns:
        float64 array of shape (n,), non-decreasing.

    Raises:
        ValueError: n < 0, rate <= 0 or NaN, burstiness <= 0 or not finite, unknown process.
    """
    process = ArrivalProcess(process)
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if not (request_rate > 0):  # also rejects NaN
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if n == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    if process is ArrivalProcess.CONSTANT:
        gaps = np.full(n - 1, 1.0 / request_rate)
    else:
        k = 1.0 if process is ArrivalProcess.POISSON else burstiness
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=k, scale=1.0 / (request_rate * k), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
