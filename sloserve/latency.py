"""Per-request latency definitions shared by the engine's metrics, the bench and the simulator
(one place, so every report means the same thing). Plain Python, no dependencies."""
from __future__ import annotations


def tpot(e2e: float, ttft: float | None, num_output_tokens: int) -> float | None:
    """Time per output token, vLLM's definition: (E2E - TTFT) / (output tokens - 1), in the
    unit of the inputs; None (undefined) for <= 1 output token or no first token."""
    if ttft is None or num_output_tokens <= 1:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)
