"""Speculative decoding through the API (``--speculative-config`` ngram, k = 4): streamed and
not, a stop string inside an accepted run, ``n = 2`` with logprobs, and
vLLM's spec-decode counters in ``/metrics`` after a scripted run. (That the tokens equal those
without drafts, a JSON-schema request's included, is tests/spec_decode/test_lossless.py's; this server is float32 under
``--batch-invariant`` so that the choices of ``n`` may be compared exactly.)"""
from __future__ import annotations

import json

import pytest

from sloserve.config import EngineConfig

pytest.importorskip("torch")

TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
        "Every cloud has a silver lining. ")
COPY = f"Repeat the text three times.\nText: {TEXT}\nRepeated: {TEXT}"
#: k = 4 at every batch size: drafts whatever the start-up measurement of their cost says (a
#: loaded host may price them out)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "num_speculative_tokens_per_batch_size": [[1, 256, 4]]}


@pytest.fixture(scope="module")
def spec_server():
    from tests.server.conftest import start_server
    srv = start_server(EngineConfig(model=None, dtype="float32", batch_invariant=True,
                                    num_kv_blocks=256, max_model_len=2048,
                                    speculative_config=SPEC))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server):
    import openai
    return openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="x", max_retries=0)


def _metrics(spec_server) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(spec_server.base_url + "/metrics").text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(("vllm:spec_decode", "vllm:generation_tokens")):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = s.value
    return out


def test_a_stop_string_inside_an_accepted_run_streamed_and_not(spec_client, spec_server):
    kw = dict(model=spec_server.model, prompt=COPY, max_tokens=60, temperature=0,
              stop=["silver"])
    full = spec_client.completions.create(**kw)
    chunks = list(spec_client.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text and "silver" not in streamed
    assert "quick brown fox" in streamed
    assert full.choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_choices_with_logprobs_are_the_same(spec_client, spec_server):
    r = spec_client.completions.create(model=spec_server.model, prompt=COPY, max_tokens=30,
                                       temperature=0, n=2, logprobs=2)
    a, b = r.choices
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
    assert a.logprobs.token_logprobs == b.logprobs.token_logprobs
    assert len(a.logprobs.tokens) == r.usage.completion_tokens / 2


def test_the_spec_decode_counters_after_a_scripted_run(spec_client, spec_server):
    before = _metrics(spec_server)
    usage = 0
    for prompt in (COPY, "Count from 1 to 50: 1, 2, 3, 4, 5,", "The history of Rome"):
        r = spec_client.completions.create(model=spec_server.model, prompt=prompt,
                                           max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True})
        usage += r.usage.completion_tokens
    after = _metrics(spec_server)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts = d["vllm:spec_decode_num_drafts_total"]
    tokens = d["vllm:spec_decode_num_draft_tokens_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    assert d["vllm:generation_tokens_total"] == usage == 120
    assert drafts > 0 and 0 < accepted < tokens <= 4 * drafts
    per = [d.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]", 0)
           for i in range(4)]
    assert sum(per) == accepted and per == sorted(per, reverse=True) and per[0] <= drafts
