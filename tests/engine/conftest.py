"""Shared helpers for the engine tests.

The scheduler and KV cache manager are plain Python; `drive_step` runs one engine iteration
against them with fake sampled tokens (no model). `TinyLlama` builds a small random Hugging Face
Llama and the matching sloserve model; `run_model_loop` drives Scheduler + KVCacheManager +
ModelRunner + Sampler the way LLMEngine.step does.
"""
from __future__ import annotations

import os
import contextlib
from dataclasses import dataclass
from typing import Callable

import pytest

from sloserve.engine.kv_cache_manager import KVCacheManager, cdiv
from sloserve.engine.messages import EngineCoreOutput
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import ModelRunnerOutput, SchedulerOutput

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------- scheduler helpers
def prompt_ids(rid: str, n: int) -> list[int]:
    """A deterministic, request-specific prompt of n token ids (never 0..9, which tests use as EOS)."""
    base = sum(map(ord, rid)) * 7
    return [10 + (base + 13 * i) % 997 for i in range(n)]


def make_request(rid: str, n_prompt: int, max_tokens: int | None = 4, *,
                 eos: tuple[int, ...] = (), **sp) -> Request:
    sp.setdefault("temperature", 0.0)
    return Request(request_id=rid, prompt_token_ids=prompt_ids(rid, n_prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids=eos)


def fake_token(req: Request) -> int:
    """The token sampled for `req`'s next output: depends only on the request id and its output
    index, so a recomputed request must produce the same sequence as an uninterrupted one."""
    return 1000 + (sum(map(ord, req.request_id)) * 31 + 17 * req.num_output_tokens) % 5000


def expected_outputs(rid: str, n: int) -> list[int]:
    class _R:  # minimal stand-in with the attributes fake_token reads
        request_id = rid
        num_output_tokens = 0
    r = _R()
    out = []
    for i in range(n):
        r.num_output_tokens = i
        out.append(fake_token(r))  # type: ignore[arg-type]
    return out


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                   max_num_seqs: int = 64, max_model_len: int = 256,
                   policy: str = "chunked") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, policy=policy)
    return Scheduler(cfg, kv)


def composition(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start position, query tokens) of every scheduled chunk, in batch order."""
    return [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def fake_runner_output(sched: Scheduler, out: SchedulerOutput,
                       token_fn: Callable[[Request], int] = fake_token) -> ModelRunnerOutput:
    """One fake token for every chunk that samples (no model)."""
    return ModelRunnerOutput(
        req_ids=[s.request_id for s in out.scheduled],
        sampled_token_ids=[[token_fn(sched.requests[s.request_id])] if s.samples else []
                           for s in out.scheduled])


def drive_step(sched: Scheduler, token_fn: Callable[[Request], int] = fake_token,
               now: float = 0.0) -> tuple[SchedulerOutput, list[Request]]:
    """schedule + fake sampling + update_from_output; returns (output, finished requests)."""
    out = sched.schedule(now)
    reqs = {s.request_id: sched.requests[s.request_id] for s in out.scheduled}
    outs: list[EngineCoreOutput] = sched.update_from_output(
        out, fake_runner_output(sched, out, token_fn), now)
    return out, [reqs[o.request_id] for o in outs if o.finished]


def check_kv_invariants(sched: Scheduler) -> None:
    """Block accounting: a block's ref count is the number of block tables holding it (more than
    one only for prefix-cache sharing), the free blocks are exactly those with none; a running
    request holds exactly ceil(num_computed_tokens / block_size) blocks; nothing else holds
    blocks; every cached hash names the block that holds it."""
    kv = sched.kv
    pool = kv.pool
    free = list(pool._free)
    assert len(set(free)) == len(free), "a block is on the free list twice"
    refs = [0] * pool.num_blocks
    for t in kv.block_tables.values():
        assert len(set(t)) == len(t), "a block twice in one block table"
        for b in t:
            refs[b] += 1
    if not kv.enable_prefix_caching:
        assert max(refs, default=0) <= 1, "a block is in two block tables"
    assert refs == pool._ref_cnt, "ref counts differ from the block tables"
    assert set(free) == {b for b in range(pool.num_blocks) if refs[b] == 0}, "a block leaked"
    for h, b in pool._cached.items():
        assert pool._hash[b] == h
    running_ids = {r.request_id for r in sched.running}
    assert {rid for rid, t in kv.block_tables.items() if t} <= running_ids
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(kv.get_block_table(r.request_id)) == cdiv(r.num_computed_tokens, kv.block_size)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert not kv.get_block_table(r.request_id)
        assert r.num_computed_tokens == 0


# ----------------------------------------------------------------------------- torch threads
@pytest.fixture(scope="module")
def single_thread():
    """Run a module's model tests on one torch thread, restoring the setting afterwards.

    On this 2-core machine other processes often hold a core; torch's spinning intra-op threads
    then make each step ~10x slower. One thread keeps the model tests fast and steady."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- tiny model
@dataclass
class TinyLlama:
    hf: object            # transformers.LlamaForCausalLM
    model: object         # sloserve.model.llama.LlamaForCausalLM
    config: object        # sloserve.model.config.ModelConfig


@pytest.fixture(scope="session")
def tiny_llama() -> TinyLlama:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from sloserve.model.config import ModelConfig
    from sloserve.model.llama import LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    sd = {k: v.clone() for k, v in hf.state_dict().items() if "rotary" not in k}
    mc = ModelConfig.from_hf_dict(cfg.to_dict())
    model = LlamaForCausalLM(mc).float().eval()
    model.load_weights(sd.items())
    return TinyLlama(hf, model, mc)


@dataclass
class LoopResult:
    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str]
    num_preemptions: int
    num_steps: int
    max_batched_tokens: int
    #: steps in which a long prompt's chunk was cut to the paced size beside decodes
    num_paced_steps: int = 0


def run_model_loop(tiny: TinyLlama, prompts: dict[str, list[int]],
                   params: dict[str, SamplingParams], *, policy: str = "chunked",
                   budget: int = 512, num_blocks: int = 256, block_size: int = 4,
                   max_num_seqs: int = 64, max_model_len: int = 512,
                   arrivals: dict[str, int] | None = None, seed: int = 0,
                   max_steps: int = 2000, kv_cache_dtype=None,
                   backend: str = "torch-ref", paced_prefill_tokens: int = 0) -> LoopResult:
    """Drive Scheduler + KVCacheManager + ModelRunner + Sampler (float32) to completion, as
    LLMEngine.step does. `arrivals[rid]` = step before which the request is added (default 0);
    `kv_cache_dtype`: the cache's (default float32); `paced_prefill_tokens`: the scheduler's
    paced chunk, as the engine would set it from its step times (0: no pacing)."""
    import torch

    from sloserve.model.attention import get_attention_backend
    from sloserve.model.runner import ModelRunner
    from sloserve.model.sampler import Sampler

    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, policy=policy), kv)
    sampler = Sampler(seed)
    runner = ModelRunner(tiny.model, tiny.config, num_blocks, block_size,
                         kv_cache_dtype or torch.float32, sampler, get_attention_backend(backend))
    arrivals = arrivals or {}
    pending = sorted(prompts, key=lambda r: arrivals.get(r, 0))
    reqs: dict[str, Request] = {}
    step = 0
    max_tokens_seen = 0
    paced_steps = 0
    sched.paced_prefill_tokens = paced_prefill_tokens
    while pending or sched.has_unfinished():
        while pending and arrivals.get(pending[0], 0) <= step:
            rid = pending.pop(0)
            reqs[rid] = Request(rid, list(prompts[rid]), params[rid])
            sched.add_request(reqs[rid])
        out = sched.schedule(float(step))
        if not out.is_empty:
            max_tokens_seen = max(max_tokens_seen, out.num_batched_tokens)
            if paced_prefill_tokens and any(s.is_decode for s in out.scheduled) and any(
                    not s.is_decode and s.num_new_tokens == paced_prefill_tokens
                    and len(reqs[s.request_id].prompt_token_ids) > sched.config.long_prompt_tokens
                    for s in out.scheduled):
                paced_steps += 1
            sched.update_from_output(out, runner.execute(out), float(step))
        else:
            assert pending, "scheduler returned an empty step with work left"
        step += 1
        assert step < max_steps, "model loop did not finish"
    assert kv.num_free_blocks == num_blocks, "KV blocks leaked at the end of the run"
    assert not kv.block_tables or not any(kv.block_tables.values())
    return LoopResult(tokens={rid: list(r.output_token_ids) for rid, r in reqs.items()},
                      finish_reasons={rid: r.status.finish_reason for rid, r in reqs.items()},
                      num_preemptions=sched.num_preemptions, num_steps=step,
                      max_batched_tokens=max_tokens_seen, num_paced_steps=paced_steps)


# ----------------------------------------------------------------------------- real tokenizer
@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded SmolLM2 tokenizer (skipped if the loader or the model package is missing)."""
    try:
        from sloserve.embedded import default_model_path
        from sloserve.tokenizer import Tokenizer
        path = default_model_path()
    except (ImportError, FileNotFoundError) as e:  # pragma: no cover - environment dependent
        pytest.skip(f"embedded model not available: {e}")
    return Tokenizer.from_gguf(path)


def require_embedded_model(kernels: bool = False) -> None:
    """Skip the calling test (or fixture) where the embedded model, or with ``kernels`` the CPU
    kernels, are not available."""
    try:
        from sloserve.embedded import default_model_path
        default_model_path()
    except (ImportError, FileNotFoundError) as e:  # pragma: no cover - environment dependent
        pytest.skip(f"embedded model not available: {e}")
    if kernels:
        from sloserve import kernels as k
        if k.load() is None:  # pragma: no cover - the kernels build wherever g++ runs
            pytest.skip("the CPU kernels do not load here")


@contextlib.contextmanager
def scheduler_budget(llm, tokens: int):
    """The engine's token budget per step lowered to ``tokens`` inside the block."""
    cfg = llm.engine.scheduler.config
    before = cfg.max_num_batched_tokens
    cfg.max_num_batched_tokens = tokens
    try:
        yield
    finally:
        cfg.max_num_batched_tokens = before
