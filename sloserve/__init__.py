"""sloserve: an LLM online-inference serving engine built around tail latency and goodput."""
from sloserve.sampling_params import SamplingParams

__all__ = ["SamplingParams", "LLM"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing sloserve must not import torch
    if name == "LLM":
        from sloserve.engine.llm import LLM
        return LLM
    raise AttributeError(name)
