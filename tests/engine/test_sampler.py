"""Sampler: greedy, top-k, top-p, temperature, per-request seeds."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sloserve.model.sampler import Sampler  # noqa: E402
from sloserve.sampling_params import SamplingParams  # noqa: E402


def random_logits(rows: int, vocab: int = 100, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax():
    logits = random_logits(8)
    sp = SamplingParams(temperature=0.0)
    out = Sampler(0)(logits, [f"r{i}" for i in range(8)], [sp] * 8)
    assert out == logits.argmax(-1).tolist()
    assert all(isinstance(t, int) for t in out)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    logits = random_logits(16, seed=1)
    s = Sampler(3)
    for _ in range(5):
        out = s(logits, [f"r{i}" for i in range(16)],
                [SamplingParams(temperature=temperature, top_k=1)] * 16)
        assert out == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = random_logits(16, seed=2)
    s = Sampler(4)
    for _ in range(5):
        out = s(logits, [f"r{i}" for i in range(16)],
                [SamplingParams(temperature=temperature, top_p=1e-6)] * 16)
        assert out == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    logits = random_logits(4, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_p=1e-9)]
    assert Sampler(0)(logits, list("abcd"), params) == logits.argmax(-1).tolist()


def _draws(sampler, rows: dict[str, torch.Tensor], order: list[str], params: dict, steps: int):
    out = {rid: [] for rid in order}
    for _ in range(steps):
        logits = torch.stack([rows[r] for r in order])
        toks = sampler(logits, order, [params[r] for r in order])
        for r, t in zip(order, toks):
            out[r].append(t)
    return out


def test_same_seed_same_tokens_regardless_of_batch():
    flat = torch.zeros(50)  # uniform: every draw is pure randomness
    rows = {"me": flat, "x": random_logits(1, 50, 7)[0], "y": flat, "z": random_logits(1, 50, 8)[0]}
    params = {"me": SamplingParams(temperature=1.0, seed=1234),
              "x": SamplingParams(temperature=1.0, seed=99),
              "y": SamplingParams(temperature=0.7),          # unseeded batch-mate
              "z": SamplingParams(temperature=0.0)}
    alone = _draws(Sampler(0), rows, ["me"], params, 20)["me"]
    batched = _draws(Sampler(0), rows, ["x", "y", "me", "z"], params, 20)["me"]
    reordered = _draws(Sampler(5), rows, ["me", "z", "y", "x"], params, 20)["me"]
    assert alone == batched == reordered
    assert len(set(alone)) > 5                    # it really is random, not constant
    # a different seed gives a different sequence
    params2 = dict(params, me=SamplingParams(temperature=1.0, seed=4321))
    assert _draws(Sampler(0), rows, ["me"], params2, 20)["me"] != alone


def test_two_requests_with_same_seed_in_one_batch_each_get_the_sequence():
    flat = torch.zeros(50)
    sp = SamplingParams(temperature=1.0, seed=42)
    both = _draws(Sampler(0), {"a": flat, "b": flat}, ["a", "b"], {"a": sp, "b": sp}, 10)
    alone = _draws(Sampler(0), {"a": flat}, ["a"], {"a": sp}, 10)
    assert both["a"] == both["b"] == alone["a"]


def test_unseeded_sampling_is_reproducible_from_engine_seed():
    flat = torch.zeros(50)
    sp = SamplingParams(temperature=1.0)
    a = _draws(Sampler(11), {"r": flat}, ["r"], {"r": sp}, 15)["r"]
    b = _draws(Sampler(11), {"r": flat}, ["r"], {"r": sp}, 15)["r"]
    c = _draws(Sampler(12), {"r": flat}, ["r"], {"r": sp}, 15)["r"]
    assert a == b
    assert a != c


def test_release_forgets_the_seed_and_the_draw_count():
    flat = torch.zeros(50)
    sp = SamplingParams(temperature=1.0, seed=5)
    s = Sampler(0)
    first = _draws(s, {"r": flat}, ["r"], {"r": sp}, 5)["r"]
    s.release("r")
    again = _draws(s, {"r": flat}, ["r"], {"r": sp}, 5)["r"]
    assert first == again  # the same seed, counted from the first draw again


def _frequencies(logits_row, sp, n=4000, seed=0):
    s = Sampler(seed)
    counts = [0] * logits_row.shape[0]
    for _ in range(n):
        counts[s(logits_row[None], ["r"], [sp])[0]] += 1
    return [c / n for c in counts]


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_temperature_sampling_follows_softmax(temperature):
    logits = torch.tensor([0.0, 1.0, 2.0])
    expected = torch.softmax(logits / temperature, -1).tolist()
    freq = _frequencies(logits, SamplingParams(temperature=temperature, seed=2024))
    for f, p in zip(freq, expected):
        # 4000 draws: std <= 0.008; 0.035 is > 4 standard deviations
        assert abs(f - p) < 0.035, (freq, expected)


def test_top_k_restricts_support_and_renormalizes():
    logits = torch.tensor([0.0, 1.0, 2.0])
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2, seed=7))
    assert freq[0] == 0.0
    p = math.exp(2) / (math.exp(1) + math.exp(2))
    assert abs(freq[2] - p) < 0.035


def test_top_p_restricts_support_and_renormalizes():
    logits = torch.tensor([0.0, 1.0, 2.0])  # probs 0.090, 0.245, 0.665
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=8))
    assert freq[0] == 0.0                   # 0.665 + 0.245 already reach 0.8
    p = math.exp(2) / (math.exp(1) + math.exp(2))
    assert abs(freq[2] - p) < 0.035
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.6, seed=8), n=300)
    assert freq == [0.0, 0.0, 1.0]          # the top token alone holds 0.665 >= 0.6


def test_tiny_temperature_is_greedy_and_never_nan():
    """1e-45 would overflow logits / T to inf and NaN probabilities; below 1e-5 is greedy."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    sp = SamplingParams(temperature=1e-45, seed=3)
    assert sp.greedy
    assert Sampler(0)(logits, ["r"], [sp]) == [1]


@pytest.mark.parametrize("kw", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                dict(top_p=float("nan")), dict(seed=2 ** 64)])
def test_non_finite_or_out_of_range_params_rejected(kw):
    from sloserve.sampling_params import ParamError
    with pytest.raises(ParamError) as e:
        SamplingParams(**kw)
    assert e.value.param == next(iter(kw))


def test_draw_matches_the_float64_inverse_cdf_across_blocks():
    """draw's two-level search picks the token a whole-row float64 prefix sum picks (V = 1,000:
    four blocks of 256, the last one padded), for 2,000 uniforms, in one call."""
    from sloserve.model.sampler import draw
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(2000, 1000, generator=g) * 2, -1)
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    ref = torch.searchsorted(probs.double().cumsum(-1),
                             (u * probs.double().sum(-1))[:, None], right=True)[:, 0]
    assert torch.equal(draw(probs, u), ref)
    p = torch.tensor([[0.25, 0.25, 0.5]] * 5)
    assert draw(p, torch.tensor([0.0, 0.2, 0.25, 0.3, 0.6], dtype=torch.float64)).tolist() == \
        [0, 0, 1, 1, 2]


def test_draw_never_picks_a_token_of_probability_zero():
    """Masked tokens (top-k / top-p / a grammar) sit at the ends of rows and blocks; a uniform
    just below 1 (whose target rounds to the row's total) must still land on an allowed one."""
    from sloserve.model.sampler import DRAW_BLOCK, draw
    V = 3 * DRAW_BLOCK + 10
    probs = torch.zeros(4, V)
    probs[0, 5] = 1.0                            # one allowed token, then zeros to the end
    probs[1, [DRAW_BLOCK - 1, DRAW_BLOCK]] = 0.5  # either side of a block boundary
    probs[2, :] = 1e-3                           # all allowed, unnormalised
    probs[3, DRAW_BLOCK + 7] = 3.0
    for u in (0.0, 0.5, 1 - 2 ** -53):
        got = draw(probs, torch.full((4,), u, dtype=torch.float64)).tolist()
        assert all(probs[r, t] > 0 for r, t in enumerate(got)), (u, got)
    assert draw(probs, torch.full((4,), 1 - 2 ** -53, dtype=torch.float64)).tolist() == \
        [5, DRAW_BLOCK, V - 1, DRAW_BLOCK + 7]


def test_draw_refuses_a_row_with_nothing_to_sample():
    from sloserve.model.sampler import draw
    ok = [0.5, 0.5]
    for bad, total in (([float("nan"), 1.0], "nan"), ([0.0, 0.0], "0.0")):
        with pytest.raises(ValueError, match=f"cannot sample row 1: .* sum to {total}"):
            draw(torch.tensor([ok, bad]), torch.zeros(2, dtype=torch.float64))


def test_half_precision_logits_at_a_tiny_temperature_sample_the_argmax():
    """fp16 logits / 1e-4 overflowed in fp16 (inf - inf = NaN, "cannot sample"); the sampler
    scales in float32 whatever the logits' dtype (a helper's finding)."""
    logits = (random_logits(3, vocab=1000, seed=9) * 7).half()
    out = Sampler(0)(logits, list("abc"), [SamplingParams(temperature=1e-4, seed=1)] * 3)
    assert out == logits.float().argmax(-1).tolist()


def test_a_tokens_draw_depends_only_on_the_seed_and_its_index():
    """The uniform of the token at index t is a function of (seed, t, stream): drawing other
    indices first, in other batches, or skipping some changes nothing; streams and seeds
    differ; the uniforms are uniform (a coarse check: 20,000 draws in 10 bins)."""
    from sloserve.model.sampler import STREAM_ACCEPT, STREAM_SAMPLE, uniform
    flat = torch.zeros(1000)
    sp = SamplingParams(temperature=1.0, seed=77)
    a = Sampler(0)(flat.expand(3, -1), ["r"] * 3, [sp] * 3, [10, 11, 12])
    s = Sampler(9)
    s(flat[None], ["r"], [sp], [3])                       # an earlier draw of another index
    b = s(flat.expand(2, -1), ["x", "r"], [SamplingParams(temperature=1.0), sp], [5, 12])
    assert b[1] == a[2] and s(flat[None], ["r"], [sp], [10]) == a[:1]
    assert uniform(77, 12) != uniform(77, 12, STREAM_ACCEPT) != uniform(78, 12)
    assert uniform(77, 12, STREAM_SAMPLE) == uniform(77, 12)
    u = torch.tensor([uniform(5, i) for i in range(20000)])
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert float(((counts - 2000) ** 2 / 2000).sum()) < 27.9  # chi-square, 9 dof, p > 0.001


@pytest.mark.parametrize("temperature", [1e38, 1e39, 1e300])
def test_a_temperature_past_float32_draws_uniformly_among_the_allowed(temperature):
    """1e39 is a valid temperature; in float32 it was inf, and a masked token's -inf / inf is
    NaN: a structured-output request's row could not be sampled (the step failed, the
    client got a 500; found by the fuzzing run on /v1/responses)."""
    logits = torch.randn(2, 10)
    logits[:, 3:] = float("-inf")  # a grammar allows tokens 0-2
    s = Sampler(seed=0)
    out = Sampler.processed(logits, [SamplingParams(temperature=temperature)] * 2)
    assert not torch.isnan(out).any()
    assert torch.isinf(out[:, 3:]).all() and torch.isfinite(out[:, :3]).all()
    for _ in range(5):
        assert all(0 <= t < 3 for t in s(logits, ["a", "b"],
                                         [SamplingParams(temperature=temperature)] * 2))


def test_a_row_that_cannot_be_sampled_gets_minus_one_and_only_it():
    """A NaN logit or a row with every token at -inf (a mask that allows nothing) gives
    UNSAMPLEABLE for that row; the others, greedy and sampled, get what they get without it
    (the runner then fails that request alone: test_scheduler's errors test)."""
    from sloserve.model.sampler import UNSAMPLEABLE
    logits = random_logits(4, vocab=300, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=6)]
    rids = list("abcd")
    clean = Sampler(0)(logits, rids, params, indices=[7, 7, 7, 7])
    bad = logits.clone()
    bad[1, 17] = float("nan")        # a sampled row with a NaN
    bad[2, :] = float("-inf")        # a greedy row with nothing allowed
    got = Sampler(0)(bad, rids, params, indices=[7, 7, 7, 7])
    assert got == [clean[0], UNSAMPLEABLE, UNSAMPLEABLE, clean[3]]
    bad[0, 3] = float("nan")         # a greedy row with a NaN
    assert Sampler(0)(bad[:1], rids[:1], params[:1], indices=[7]) == [UNSAMPLEABLE]
