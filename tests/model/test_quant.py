"""Quantized weights: every GGUF encoding maps onto the engine's formats with exactly gguf's own
dequantized values; requantization; the fused quantized path against the dense float32
reference on the embedded model (logits within a stated tolerance, greedy tokens equal)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sloserve.model.quant import concat_rows, from_gguf, quantize_int4, quantize_int8

FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.mark.parametrize("tname", sorted(FP16_FIELDS))
def test_gguf_encodings_map_exactly(tname):
    """Random blocks (sane fp16 scales) of every mapped encoding: our codes, scales and offsets
    dequantize to exactly what gguf.quants.dequantize gives."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    qt = GGMLQuantizationType[tname]
    bs, ts = GGML_QUANT_SIZES[qt]
    n, k = 6, 512
    rng = np.random.default_rng(len(tname))
    raw = rng.integers(0, 256, size=(n * k // bs, ts), dtype=np.uint8)
    for row in raw:
        for p in FP16_FIELDS[tname]:
            row[p:p + 2] = np.frombuffer(np.float16(rng.uniform(-0.1, 0.1)).tobytes(), np.uint8)
    ref = dequantize(raw.reshape(n, -1), qt).reshape(n, k)
    w = from_gguf(raw, tname, (n, k))
    assert np.array_equal(w.dequantize().numpy(), ref)
    assert (w.bits, w.group_size) == {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32),
                                      "Q6_K": (8, 16), "Q3_K": (8, 16), "Q2_K": (8, 16)}.get(
        tname, (8, 32))


def test_unmapped_encodings_and_sizes_are_refused():
    with pytest.raises(ValueError, match="no exact mapping for GGUF type IQ4_NL"):
        from_gguf(np.zeros(18, np.uint8), "IQ4_NL", (1, 32))
    with pytest.raises(ValueError, match="Q8_0 data of 33 bytes does not fit"):
        from_gguf(np.zeros(33, np.uint8), "Q8_0", (1, 32))


def test_requantization_error_and_layout():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q8, q4 = quantize_int8(w, "F32"), quantize_int4(w, "F32")
    # int8: |err| <= d / 2 = max|w| / 254 per group; int4: <= (max - min) / 30
    g = w.reshape(64, 8, 32)
    assert ((q8.dequantize() - w).reshape(64, 8, 32).abs()
            <= g.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()
    assert ((q4.dequantize() - w).reshape(64, 8, 32).abs()
            <= (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 30 + 1e-6).all()
    assert q8.source == "int8 from F32" and q4.nbytes == 64 * 128 + 2 * 64 * 8 * 4
    both = concat_rows([q4, q4.select_rows(torch.arange(63, -1, -1))])
    assert both.shape == (128, 256)
    assert torch.equal(both.dequantize()[64:], q4.dequantize().flip(0))
    assert concat_rows([q4, q8]) is None  # different formats are not fused


# --------------------------------------------------------------------------- the embedded model
PROMPTS = ["The quick brown fox jumps over the lazy dog. In 1969, humans first walked on the",
           "def fibonacci(n):", "Hello, my name is"]


@pytest.fixture(scope="module")
def engines():
    """The embedded model in float32: served as stored (fused kernels) and --enforce-eager (the
    same weight values, dense, on torch)."""
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve import kernels
    if kernels.load() is None:
        pytest.skip("no CPU kernels on this machine")
    base = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=256)
    return (LLMEngine(EngineConfig(**base)), LLMEngine(EngineConfig(**base, enforce_eager=True)))


def _logits(eng, ids: list[int]) -> torch.Tensor:
    """Next-token logits at the last prompt position, one decode step's worth (the prompt
    prefilled, then its last token recomputed as a decode-sized step)."""
    from sloserve.model.runner import build_step_inputs
    from sloserve.sampling_params import SamplingParams
    from sloserve.step_io import ScheduledRequest, SchedulerOutput
    r = eng.runner
    sp = SamplingParams(temperature=0.0)
    blocks = list(range(-(-len(ids) // 16)))
    out = SchedulerOutput([ScheduledRequest("x", 0, len(ids), ids, blocks, sp, True, False)])
    inp = build_step_inputs(out, 16)
    return r.model(inp.input_ids, inp.positions, r.kv_caches, r.attn_backend,
               r.attn_backend.build_metadata(inp), inp.logits_indices)[0]


def test_quantized_path_logits_match_the_dense_reference(engines):
    """Tolerance: the fused path multiplies the exact same weight values in float32 with
    another summation order, so logits agree to ~1e-5 of their range (measured max 2.3e-5
    relative here); stated bound 1e-4."""
    fast, eager = engines
    assert fast.runner.model.kernels is not None and eager.runner.model.kernels is None
    for p in PROMPTS:
        ids = fast.tokenizer.encode(p)[:16]
        a, b = _logits(fast, ids), _logits(eager, ids)
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel < 1e-4, (p, rel)
        assert int(a.argmax()) == int(b.argmax())


def test_greedy_tokens_identical_for_32_tokens(engines):
    from sloserve.sampling_params import SamplingParams
    fast, eager = engines
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for p in PROMPTS:
        outs = []
        for eng in engines:
            rid = eng.add_request(p, sp)
            final = None
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.request_id == rid and o.finished:
                        final = o
            outs.append(final.token_ids)
        assert outs[0] == outs[1] and len(outs[0]) == 32, p


def test_fused_layer_calls_give_the_separate_kernels_logits_bit_for_bit():
    """With int8 activations (the default dtype) and every weight in the x16 layout, a quantized
    step runs each layer after its attention as one ``x16_layer_tail`` call: its logits are the
    separate kernels' bit for bit, for a 16-token and a 130-token prefill (the longer one splits
    the activation quantization into work items) and a decode-sized step."""
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve import kernels
    if kernels.load() is None:
        pytest.skip("no CPU kernels on this machine")
    eng = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=256))
    model = eng.runner.model
    assert model.fused_layers and model.policy.quant_max_tokens >= 1
    ids = eng.tokenizer.encode(" ".join(PROMPTS) * 8)
    assert len(ids) >= 130
    for n in (1, 16, 130):
        if n > model.policy.quant_max_tokens:  # a dense step: no fused layers to compare
            continue
        out = []
        for fused in (True, False):
            model.fused_layers = fused
            out.append(_logits(eng, ids[:n]))
        model.fused_layers = True
        assert torch.equal(out[0], out[1]), n


def test_paced_long_prompt_beside_a_decode_keeps_greedy_tokens(engines, monkeypatch):
    """Prefill pacing on the fused kernels: a long prompt prefilled in 16-token chunks beside a
    decoding request (the paced size forced, as the engine would measure it) gives both
    requests the greedy tokens they get with pacing off (whole-budget chunks)."""
    from sloserve.engine.admission import StepRates
    from sloserve.sampling_params import SamplingParams
    fast, _ = engines
    sched = fast.scheduler
    long_ids = fast.tokenizer.encode(" ".join(PROMPTS) * 40)
    long_ids = long_ids[:min(len(long_ids), sched.config.long_prompt_tokens + 150)]
    assert len(long_ids) > sched.config.long_prompt_tokens
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    monkeypatch.setattr(StepRates, "paced_prefill_tokens", property(lambda self: 16))
    tokens, paced = {}, {}
    schedule = sched.schedule
    for pacing in (True, False):
        sched.config.enable_prefill_pacing = pacing
        comps = []  # (decodes, prefill chunk sizes) of every step

        def spy(now=0.0):
            out = schedule(now)
            comps.append((sum(s.is_decode for s in out.scheduled),
                          [s.num_new_tokens for s in out.scheduled if not s.is_decode]))
            return out
        sched.schedule = spy
        try:
            short = fast.add_request(PROMPTS[0], sp)
            fast.step()  # its prompt: from here on it decodes
            long = fast.add_request(long_ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                             ignore_eos=True))
            done = {}
            while fast.has_unfinished_requests():
                for o in fast.step():
                    if o.finished:
                        done[o.request_id] = o.token_ids
        finally:
            sched.schedule = schedule
            sched.config.enable_prefill_pacing = True
        tokens[pacing] = (done[short], done[long])
        paced[pacing] = sum(1 for d, chunks in comps if d and 16 in chunks)
    assert tokens[True] == tokens[False]
    assert len(tokens[True][0]) == 40 and len(tokens[True][1]) == 8
    assert paced[True] >= len(long_ids) // 16 - 1 and paced[False] <= 1
