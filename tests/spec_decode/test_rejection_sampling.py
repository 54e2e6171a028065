"""Speculative sampling keeps the target's distribution: on a tiny random model (vocabulary 48,
float32; the best attention backend here), requests verify drafts at positions 3.. after a prompt of
three tokens, one request per seed, 20,000 seeds per case, and the token kept at each verified
position follows the target's distribution there (chi-square, p > 0.001), with rejections.

* sample-and-match of forced drafts (the likeliest token, then an unlikely one): the path of
  n-gram and suffix drafts at temperature 1 and under top-k + top-p;
* rejection sampling of ``probabilistic`` ``layer_skip`` drafts (the first of the model's two
  layers: a q far from p): the token kept first follows p, the token kept second (given the
  first draft was accepted) follows p given that draft, and the first draft's acceptance rate
  equals sum min(p, q) within 3 standard errors.

Each request is driven through the model runner itself (``ModelRunner.execute``: the drafter,
the verify pass, the sampler), one step of 1,000 requests at a time; the expected p and q come
from separate forward passes of the same model (their float32 rounding differs from the verify
step's by ~1e-7, far below what 20,000 samples can see)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sloserve.model.attention import get_attention_backend  # noqa: E402
from sloserve.model.config import ModelConfig  # noqa: E402
from sloserve.model.draft import ModelDrafter  # noqa: E402
from sloserve.model.llama import LlamaForCausalLM  # noqa: E402
from sloserve.model.runner import ModelRunner  # noqa: E402
from sloserve.model.sampler import Sampler  # noqa: E402
from sloserve.sampling_params import SamplingParams  # noqa: E402
from sloserve.step_io import DRAFT_PLACEHOLDER, ScheduledRequest, SchedulerOutput  # noqa: E402

VOCAB = 48
PROMPT = [5, 17, 30, 9]   # positions 0..3: the drafts sit at positions 4.. (>= 3)
SEEDS = 20_000
BATCH = 1_000
BLOCK = 4                 # block 0: the prompt (shared), block 1 + i: request i's verify
P_MIN = 1e-3
SHARPEN = 6.0   # the LM head scaled: a few likely tokens, a long tail


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread: tiny ops on two spinning threads are ~10x slower beside other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper than the default init: a few likely tokens, a long tail
        hf.lm_head.weight.mul_(SHARPEN)
    mc = ModelConfig.from_hf_dict(cfg.to_dict())
    model = LlamaForCausalLM(mc).float().eval()
    model.load_weights((k, v.clone()) for k, v in hf.state_dict().items() if "rotary" not in k)
    return model, mc


def make_runner(tiny, layer_skip: bool) -> ModelRunner:
    model, mc = tiny
    runner = ModelRunner(model, mc, BATCH + 1, BLOCK, torch.float32, Sampler(0),
                         get_attention_backend("auto"))
    if layer_skip:
        runner.drafter = ModelDrafter(model, runner.kv_caches, 1, runner.attn_backend, BLOCK,
                                      runner.sampler, probabilistic=True, catch_up=False)
    prefill = ScheduledRequest("prompt", 0, 3, PROMPT[:3], [0], SamplingParams(max_tokens=1),
                               samples=False, is_decode=False)
    runner.execute(SchedulerOutput([prefill]))  # the prompt's KV at positions 0..2, block 0
    return runner


def probs(tiny, context: list[int], sp: SamplingParams, num_layers: int | None = None):
    """The distribution a request samples from after ``context`` (its processed logits'
    softmax), from a fresh forward pass of the whole context."""
    model, mc = tiny
    runner = ModelRunner(model, mc, 8, BLOCK, torch.float32, Sampler(0),
                         get_attention_backend("auto"))
    n = len(context)
    from sloserve.model.runner import build_step_inputs
    sr = ScheduledRequest("p", 0, n, list(context), list(range(-(-n // BLOCK))), sp,
                          samples=True, is_decode=False)
    inputs = build_step_inputs(SchedulerOutput([sr]), BLOCK)
    meta = runner.attn_backend.build_metadata(inputs)
    logits = model(inputs.input_ids, inputs.positions, runner.kv_caches, runner.attn_backend,
                   meta, inputs.logits_indices, num_layers)[0]
    return torch.softmax(Sampler.processed_logits(logits.float(), sp), -1).double()


def verify_all(runner, sp: SamplingParams, drafts: list[int]) -> list[tuple[list[int], list[int]]]:
    """(drafts, kept tokens) of SEEDS requests, request i seeded i, each verifying ``drafts``
    (placeholders: the runner's drafter fills them in) after PROMPT."""
    got = []
    for first in range(0, SEEDS, BATCH):
        step = []
        for i in range(first, first + BATCH):
            rsp = SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                 seed=i, max_tokens=8)
            step.append(ScheduledRequest(f"r{i}", 3, 1 + len(drafts), [PROMPT[3]] + drafts,
                                         [0, 1 + i - first], rsp, samples=True, is_decode=True,
                                         spec_token_ids=list(drafts), num_prompt_tokens=3))
        res = runner.execute(SchedulerOutput(step, finished_request_ids=[
            f"r{i}" for i in range(first - BATCH, first)]))
        used = res.draft_token_ids or [drafts] * BATCH
        got += list(zip(used, res.sampled_token_ids))
    return got


def chi_square_p(samples: list[int], p: torch.Tensor) -> float:
    """The p-value of ``samples`` under the distribution ``p`` (cells of expected count < 5
    pooled into one)."""
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = p * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # nothing much left in the tail: fold it into the last big cell
        obs, exp = torch.cat([obs[:-2], (obs[-2] + obs[-1])[None]]), \
            torch.cat([exp[:-2], (exp[-2] + exp[-1])[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=12, top_p=0.9)]


@pytest.mark.parametrize("sp", CASES, ids=["t1", "topk_topp"])
def test_forced_drafts_keep_the_target_distribution(tiny, sp):
    p0 = probs(tiny, PROMPT, sp)
    likely, unlikely = int(p0.argmax()), int(p0.argsort()[VOCAB // 2])
    p1 = probs(tiny, PROMPT + [likely], sp)
    runner = make_runner(tiny, layer_skip=False)
    got = verify_all(runner, sp, [likely, unlikely])
    first = [kept[0] for _, kept in got]
    assert chi_square_p(first, p0) > P_MIN
    second = [kept[1] for _, kept in got if len(kept) > 1]  # the first draft was accepted
    assert chi_square_p(second, p1) > P_MIN
    rejected = sum(1 for _, kept in got if len(kept) < 3)
    assert rejected > 0 and len(second) > 0
    # the first draft is kept with its probability under p (a point-mass q)
    rate, pl = len(second) / SEEDS, float(p0[likely])
    assert abs(rate - pl) < 3 * (pl * (1 - pl) / SEEDS) ** 0.5


@pytest.mark.parametrize("sp", CASES, ids=["t1", "topk_topp"])
def test_probabilistic_drafts_keep_the_target_distribution(tiny, sp):
    p0 = probs(tiny, PROMPT, sp)
    q0 = probs(tiny, PROMPT, sp, num_layers=1)
    assert float((p0 - q0).abs().sum()) > 0.15  # q is not p: rejections are common
    runner = make_runner(tiny, layer_skip=True)
    got = verify_all(runner, sp, [DRAFT_PLACEHOLDER] * 2)
    first = [kept[0] for _, kept in got]
    assert chi_square_p(first, p0) > P_MIN
    accepted = [(d, kept) for d, kept in got if len(kept) > 1]
    assert 0 < len(accepted) < SEEDS  # rejections and acceptances
    expect = float(torch.minimum(p0, q0).sum())
    rate = len(accepted) / SEEDS
    assert abs(rate - expect) < 3 * (expect * (1 - expect) / SEEDS) ** 0.5
    # the second kept token, given the first draft d was accepted, follows p(. | PROMPT + d):
    # for the most common accepted d
    d = max(set(a[0][0] for a in accepted), key=lambda t: sum(1 for a in accepted
                                                              if a[0][0] == t))
    second = [kept[1] for dr, kept in accepted if dr[0] == d]
    assert len(second) > 1000
    assert chi_square_p(second, probs(tiny, PROMPT + [d], sp)) > P_MIN
