"""Parity with Hugging Face transformers (same weights, float32).

Tolerance: max |logit difference| < 1e-3 over every position of a prompt, computed through the
paged-KV path (prompt split into chunks over several steps, so cached-context attention is covered),
and 32 greedy tokens identical to transformers' own greedy decoding.
"""
from __future__ import annotations

import pytest
import torch

from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.request import Request
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.model.loader import load_model
from sloserve.model.attention import get_attention_backend
from sloserve.model.runner import ModelRunner, build_step_inputs
from sloserve.model.sampler import Sampler
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import ModelRunnerOutput

LOGIT_TOL = 1e-3
PROMPT = "The quick brown fox jumps over the lazy dog. In 1969, humans first walked on the"


def paged_prompt_logits(model, config, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [T, V] for every prompt position, computed chunk by chunk through the paged cache."""
    kv = KVCacheManager(64, 4)
    attn = get_attention_backend("torch-ref")
    runner = ModelRunner(model, config, 64, 4, torch.float32, Sampler(0), attn)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=512), kv)
    req = Request("p", ids, SamplingParams(temperature=0, max_tokens=1))
    sched.add_request(req)
    rows = []
    while sched.has_unfinished():
        out = sched.schedule()
        inputs = build_step_inputs(out, 4)
        logits = model(inputs.input_ids, inputs.positions, runner.kv_caches, attn,
                       attn.build_metadata(inputs), torch.arange(inputs.num_tokens))
        rows.append(logits)
        sched.update_from_output(out, runner_output(out, int(logits[-1].argmax())))
    return torch.cat(rows)


def runner_output(out, tok: int) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[s.request_id for s in out.scheduled],
                             sampled_token_ids=[[tok] if s.samples else [] for s in out.scheduled])


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """transformers greedy decoding, n tokens, never stopping at EOS."""
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        for _ in range(n):  # full recompute each step: the plainest reference
            tok = int(hf_model(x).logits[0, -1].argmax())
            out.append(tok)
            x = torch.cat([x, torch.tensor([[tok]])], dim=1)
    return out


def ours_greedy(path, ids: list[int], n: int) -> list[int]:
    from sloserve.engine.llm import LLM
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    o = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    return o.token_ids


def _check(path, hf_model, tokenizer):
    model, w = load_model(path, dtype="float32")
    ids = w.tokenizer.encode(PROMPT)
    assert ids == tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    for chunk in (len(ids), 5):
        ours = paged_prompt_logits(model, w.config, ids, chunk)
        diff = (ours - ref).abs().max().item()
        print(f"{path}: chunk {chunk}: max |logit diff| {diff:.2e}")
        assert diff < LOGIT_TOL, f"chunk {chunk}: max |logit diff| {diff:.2e}"
    assert ours_greedy(path, ids, 32) == hf_greedy(hf_model, ids, 32)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir",
                                     "tiny_mqa_dir", "tiny_mha_dir"])
def test_tiny_checkpoint_parity(fixture, request, smollm2_hf_tokenizer):
    from transformers import AutoModelForCausalLM
    path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check(path, hf, smollm2_hf_tokenizer)


def test_embedded_model_parity(gguf_path, smollm2_hf_model, smollm2_hf_tokenizer):
    _check(gguf_path, smollm2_hf_model, smollm2_hf_tokenizer)
