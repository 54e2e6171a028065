"""The embedded model's greedy tokens at default engine flags, held as literals: a change to the
model code, its layers or the kernels' dispatch that changes a served token fails here.

Greedy decoding in bfloat16 depends on the CPU's kernels (their variant, AMX, the dtype ``auto``
picks) and on which path serves each step (quantized weights up to ``quant_max_tokens``, the AMX
GEMM up to ``amx_max_tokens``, oneDNN above). Those crossovers are measured at start-up and move
with the host's load, so the test pins them (to the values below); the bf16 tokens are checked
only on a host whose facts are the recorded ones, and skipped with the reason elsewhere. The
float32 tokens (``--dtype float32``: float32 activations everywhere) are checked on every CPU.

Each set is run twice: the prompts as one batch (their prefills share steps, their decodes are
batched) and one prompt alone (its prefix cache emptied first).
"""
from __future__ import annotations

import pytest

from sloserve.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three children. Every morning the woodcutter",
    "Q: What is 12 times 7?\nA:",
    "Write a haiku about the sea.",
    "The following is a list of the planets of the solar system, ordered by their distance "
    "from the sun: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune. The "
    "largest of them is Jupiter, a gas giant whose mass is more than twice that of all the "
    "other planets combined. The smallest planet is",
]
MAX_TOKENS = [16, 24, 32, 16, 24, 32]
#: the prompt also run alone (35 tokens: its prefill is an AMX step where there is AMX)
ALONE = 2

#: the crossovers pinned for these runs: 1-6 token steps (decodes) on the quantized weights,
#: 7-48 token steps (the lone prompt's prefill) on the AMX GEMM where there is one, larger
#: (the batch's 145-token prefill) on oneDNN
QUANT_MAX_TOKENS = 6
AMX_MAX_TOKENS = 48

#: the facts that decide the bfloat16 tokens below (this project's AVX-512 + AMX Xeon host)
BF16_FACTS = {"kernel_variant": "avx512", "amx": True, "dtype": "bfloat16"}

BF16_BATCH = [
    [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33],
    [3725, 198, 198, 1348, 6230, 2925, 253, 35881, 2424, 288, 7529, 260, 304, 373, 24681, 46477,
     1230, 30, 378, 8379, 1517, 2179, 38572, 46477],
    [736, 1188, 260, 1296, 1122, 284, 919, 253, 15513, 578, 282, 253, 3800, 282, 3180, 30, 909,
     736, 2304, 260, 3180, 618, 1165, 4443, 28, 284, 965, 384, 736, 722, 601, 288],
    [216, 33, 34, 1672, 216, 39, 446, 216, 39, 40, 198, 50, 42, 216, 33, 34],
    [198, 198, 504, 3426, 314, 253, 1666, 282, 11746, 4558, 28, 198, 49, 1379, 837, 260, 6376, 314,
     11636, 351, 4683, 28, 198, 49],
    [24254, 28, 527, 436, 5178, 429, 260, 3693, 817, 281, 216, 34, 32, 32, 38, 30, 198, 198, 504,
     3925, 351, 260, 768, 22995, 314, 14713, 28, 351, 216, 33, 34, 39],
]
BF16_ALONE = [736, 11368, 614, 288, 1042, 253, 811, 28, 253, 4516, 28, 253, 22951, 28, 253, 22913,
              28, 253, 9956, 28, 253, 6342, 28, 253, 9610, 28, 253, 14600, 28, 253, 16438, 28]
FP32_BATCH = [
    [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33],
    [3725, 198, 198, 1348, 6230, 2925, 253, 35881, 2424, 288, 7529, 260, 24681, 46477, 5972, 30,
     378, 8379, 1517, 2179, 38572, 46477, 24, 94],
    [736, 1188, 253, 1165, 3800, 282, 260, 3150, 284, 919, 253, 1838, 16253, 327, 650, 1296, 1122,
     30, 909, 736, 1188, 253, 3800, 282, 260, 16253, 284, 919, 253, 1838, 16253, 327],
    [216, 33, 34, 1672, 216, 39, 446, 216, 40, 32, 198, 50, 42, 216, 33, 34],
    [198, 198, 504, 3426, 314, 253, 8604, 282, 260, 1205, 8664, 30, 2, 198, 1, 520, 9531, 198, 504,
     3426, 314, 253, 8604, 282],
    [24254, 28, 527, 436, 298, 36368, 347, 253, 19119, 3925, 281, 216, 34, 32, 32, 38, 30, 198,
     198, 504, 3995, 3925, 314, 30461, 28, 527, 314, 260, 20633, 3925, 281, 653],
]
FP32_ALONE = [736, 1188, 253, 1165, 3800, 282, 260, 3150, 284, 919, 253, 1838, 16253, 327, 650,
              1296, 1122, 30, 909, 736, 1188, 253, 3800, 282, 260, 16253, 284, 919, 253, 1838,
              16253, 327]


def _pin_crossovers(monkeypatch) -> None:
    from sloserve.model import crossover
    monkeypatch.setattr(crossover, "quant_crossover", lambda model, **k: QUANT_MAX_TOKENS)
    monkeypatch.setattr(crossover, "amx_crossover", lambda model: AMX_MAX_TOKENS)


def _facts(llm) -> dict:
    from sloserve import kernels
    k = kernels.load()
    core = llm.engine.core
    return {"kernel_variant": k.variant if k is not None else None,
            "amx": bool(k is not None and k.amx),
            "dtype": core.dtype_choice.dtype}


def _run(llm) -> tuple[list[list[int]], list[int]]:
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    batch = [list(o.token_ids) for o in llm.generate(PROMPTS, sps)]
    llm.engine.core.reset_prefix_cache()  # the lone prompt computed whole, as on a new engine
    alone = list(llm.generate(PROMPTS[ALONE], sps[ALONE])[0].token_ids)
    assert [len(t) for t in batch] == MAX_TOKENS and len(alone) == MAX_TOKENS[ALONE]
    return batch, alone


def test_default_flags_bf16_tokens(monkeypatch):
    from sloserve import LLM
    _pin_crossovers(monkeypatch)
    llm = LLM()
    facts = _facts(llm)
    if facts != BF16_FACTS:
        pytest.skip(f"the bf16 tokens were recorded on {BF16_FACTS}; this host is {facts}")
    batch, alone = _run(llm)
    assert batch == BF16_BATCH
    assert alone == BF16_ALONE


def test_float32_tokens(monkeypatch):
    from sloserve import LLM
    _pin_crossovers(monkeypatch)
    llm = LLM(dtype="float32")
    batch, alone = _run(llm)
    assert batch == FP32_BATCH
    assert alone == FP32_ALONE
