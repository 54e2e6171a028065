"""LLMEngine / LLM end to end on the embedded SmolLM2-135M model (float32)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from sloserve.sampling_params import ParamError, SamplingParams  # noqa: E402
from tests.engine.conftest import require_embedded_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

NUM_KV_BLOCKS = 256
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm():
    require_embedded_model()
    import sloserve
    return sloserve.LLM(model=None, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def engine(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    yield eng
    # leave the shared engine clean for the next test
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_engine_shape(engine):
    assert engine.num_kv_blocks == NUM_KV_BLOCKS
    assert engine.kv.num_free_blocks == NUM_KV_BLOCKS
    assert engine.dtype.is_floating_point and str(engine.dtype) == "torch.float32"
    assert engine.tokenizer is not None


def test_greedy_is_deterministic_and_batch_independent(llm, engine):
    sp = greedy(8, ignore_eos=True)
    first = llm.generate(PROMPTS, sp)
    second = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert [o.text for o in first] == [o.text for o in second]
    alone = llm.generate(PROMPTS[1], sp)[0]
    assert alone.token_ids == first[1].token_ids
    # outputs come back in prompt order with the usage filled in
    for prompt, o in zip(PROMPTS, first):
        assert o.finished and o.finish_reason == "length"
        assert o.num_prompt_tokens == len(engine.tokenizer.encode(prompt))
        assert o.text == engine.tokenizer.decode(o.token_ids)
    assert engine.kv.num_free_blocks == NUM_KV_BLOCKS


@pytest.mark.parametrize("n", [1, 5])
def test_max_tokens_honoured(llm, engine, n):
    (o,) = llm.generate(["Once upon a time"], greedy(n, ignore_eos=True))
    assert len(o.token_ids) == n == o.num_output_tokens
    assert o.finish_reason == "length"


def test_token_id_prompts(llm, engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    by_text = llm.generate(PROMPTS[0], greedy(4, ignore_eos=True))[0]
    by_ids = llm.generate(ids, greedy(4, ignore_eos=True))[0]
    assert by_ids.token_ids == by_text.token_ids


@pytest.mark.parametrize("prompt", ["", [[]]])
def test_empty_prompt_is_a_param_error(llm, engine, prompt):
    with pytest.raises(ParamError, match="at least 1 token") as ei:
        llm.generate(prompt, greedy(4))
    assert ei.value.param == "prompt"
    assert not engine.has_unfinished_requests()


def test_prompt_plus_max_tokens_over_max_model_len(llm, engine):
    limit = engine.max_model_len
    n, mt = limit - 10, 25
    with pytest.raises(ParamError) as ei:
        llm.generate([[5] * n], greedy(mt))
    msg = str(ei.value)
    assert str(n) in msg and str(mt) in msg and str(limit) in msg and str(n + mt) in msg
    assert ei.value.param == "max_tokens"
    assert not engine.has_unfinished_requests()


def test_a_prompt_over_max_model_len_is_the_param_named(llm, engine):
    """With max_tokens given, a prompt that alone fills the context names ``prompt`` (the field
    to change), not ``max_tokens``."""
    limit = engine.max_model_len
    with pytest.raises(ParamError, match="maximum context length") as ei:
        llm.generate([[5] * limit], greedy(4))
    assert ei.value.param == "prompt"
    assert not engine.has_unfinished_requests()


def test_request_larger_than_kv_cache_is_rejected(engine):
    """max_model_len (8192 for SmolLM2) exceeds what 256 blocks x 16 tokens hold (4096). A request
    that fits max_model_len but not the KV cache can never finish: prompt + max_tokens must be
    validated against the KV capacity too (or max_model_len capped to it), else generate() hangs.
    Either fix makes this a ParamError."""
    capacity = engine.num_kv_blocks * engine.config.block_size
    with pytest.raises(ParamError) as ei:
        engine.make_request([5] * (capacity - 10), greedy(100))
    assert ei.value.param == "max_tokens"
    with pytest.raises(ParamError) as ei:
        engine.make_request([5] * capacity, greedy(1))
    assert ei.value.param == "prompt"


def test_generate_rejects_kv_oversized_prompt_without_queueing_others(llm, engine):
    """LLM.generate promises a ParamError with nothing queued; a prompt longer than the KV cache
    (but within max_model_len) must not leave the other prompts of the call queued."""
    capacity = engine.num_kv_blocks * engine.config.block_size
    with pytest.raises(ParamError):
        llm.generate([[5] * 4, [5] * (capacity + 1)], greedy(1))
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks(engine):
    rid = engine.add_request(PROMPTS[0] * 20, greedy(50, ignore_eos=True))
    other = engine.add_request(PROMPTS[1], greedy(50, ignore_eos=True))
    engine.step()
    assert engine.kv.num_free_blocks < NUM_KV_BLOCKS
    held = len(engine.kv.get_block_table(rid))
    assert held > 0
    free = engine.kv.num_free_blocks
    out = engine.abort_request(rid)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.kv.num_free_blocks == free + held
    assert engine.abort_request(rid) is None            # already gone
    engine.abort_request(other)
    assert engine.kv.num_free_blocks == NUM_KV_BLOCKS
    assert not engine.has_unfinished_requests()
    assert engine.output_processor.get_state(rid) is None
    assert not engine.output_processor.has_unfinished()


def test_streamed_deltas_add_up(engine):
    rid = engine.add_request(PROMPTS[0], greedy(12, ignore_eos=True))
    deltas, ids, last = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            deltas.append(o.new_text)
            ids += o.new_token_ids
            last = o
    assert last.finished and last.finish_reason == "length"
    assert ids == last.token_ids and len(ids) == 12
    assert "".join(deltas) == last.text == engine.tokenizer.decode(ids)
    assert engine.kv.num_free_blocks == NUM_KV_BLOCKS


def test_stop_string_and_stop_token(llm, engine):
    base = llm.generate(PROMPTS[0], greedy(12, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    with_stop = llm.generate(PROMPTS[0], greedy(12, ignore_eos=True, stop=[stop]))[0]
    assert with_stop.finish_reason == "stop"
    assert with_stop.text == text[:text.index(stop)]
    assert stop not in with_stop.text
    # a stop token id: generation ends at it and its text is not shown
    tok = base.token_ids[4]
    k = base.token_ids.index(tok)
    st = llm.generate(PROMPTS[0], greedy(12, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert st.finish_reason == "stop"
    assert st.token_ids == base.token_ids[:k + 1]
    assert st.text == engine.tokenizer.decode(base.token_ids[:k])
    assert engine.kv.num_free_blocks == NUM_KV_BLOCKS


def test_abort_output_keeps_text_so_far(engine):
    """RequestOutput.text is "all visible text so far": the output returned by abort_request must
    carry the text already streamed, consistent with its token_ids."""
    rid = engine.add_request(PROMPTS[0], greedy(30, ignore_eos=True))
    last = None
    for _ in range(6):
        for o in engine.step():
            last = o
    assert last is not None and last.text and not last.finished
    out = engine.abort_request(rid)
    assert out.finish_reason == "abort"
    assert out.token_ids == last.token_ids
    assert out.text == last.text


def test_stop_string_completed_by_last_allowed_token_reports_stop(llm, engine):
    """When the token that completes a stop string is also the max_tokens-th token, the stop string
    ended the output (it is cut from the text), so finish_reason must be "stop", not "length"."""
    tok = engine.tokenizer
    base = llm.generate(PROMPTS[0], greedy(10, ignore_eos=True))[0]
    # a short stop string whose first occurrence ends inside the k-th output token
    for k in range(10, 2, -1):
        before, upto = tok.decode(base.token_ids[:k - 1]), tok.decode(base.token_ids[:k])
        stop = upto[-2:]
        if len(upto) > len(before) and stop.strip() and stop not in before \
                and upto.index(stop) + len(stop) > len(before):
            break
    else:
        pytest.skip("no suitable stop string in this generation")
    o = llm.generate(PROMPTS[0], greedy(k, ignore_eos=True, stop=[stop]))[0]
    assert o.text == upto[:upto.index(stop)]
    assert o.finish_reason == "stop"


def test_generate_rejects_mismatched_sampling_params_list(llm, engine):
    """Two prompts with one SamplingParams in a list: the second prompt must not be dropped
    silently (vLLM raises ValueError)."""
    try:
        outs = llm.generate(["a b c", "d e f"], [greedy(1)])
    except ValueError:
        return
    assert len(outs) == 2, f"generate silently dropped prompts: {len(outs)} outputs for 2 prompts"


def test_failed_model_step_aborts_its_requests_and_engine_recovers(engine, monkeypatch):
    rid = engine.add_request(PROMPTS[0], greedy(4, ignore_eos=True))

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(engine.runner, "execute", boom)
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid]
    assert outs[0].finished and outs[0].finish_reason == "abort"
    assert "kaboom" in outs[0].error
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == NUM_KV_BLOCKS
    monkeypatch.undo()
    rid2 = engine.add_request(PROMPTS[0], greedy(2, ignore_eos=True))
    final = [o for _ in range(10) for o in engine.step() if o.finished]
    assert [o.request_id for o in final] == [rid2] and len(final[0].token_ids) == 2


@pytest.mark.parametrize("prompt,params,param", [
    ([1.0, 2.0], greedy(2), "prompt"),                      # float ids: rejected, nothing queued
    ([True, 5], greedy(2), "prompt"),
    ("Hi", greedy(2, stop_token_ids=[10 ** 9]), "stop_token_ids"),
])
def test_bad_ids_are_param_errors_and_leave_the_engine_clean(llm, engine, prompt, params, param):
    with pytest.raises(ParamError) as ei:
        llm.generate([prompt], params)
    assert ei.value.param == param
    assert not engine.has_unfinished_requests()
    assert llm.generate(["Hello"], greedy(3))[0].num_output_tokens == 3


def test_stop_string_limits():
    with pytest.raises(ParamError, match="at most 32 strings") as ei:
        SamplingParams(stop=[f"s{i}" for i in range(33)])
    assert ei.value.param == "stop"
    with pytest.raises(ParamError, match="at most 1024 characters"):
        SamplingParams(stop=["x" * 1025])
    SamplingParams(stop=[f"s{i}" for i in range(32)])  # at the limit: fine


def test_a_failing_detokenizer_fails_only_its_request(llm, engine, monkeypatch):
    """An exception while processing one request's output ends that request with an error and
    keeps the step's other outputs."""
    a = engine.add_request("Hello", greedy(4), request_id="a")
    b = engine.add_request("Hello", greedy(4), request_id="b")
    boom = engine.output_processor.get_state("a").detok
    monkeypatch.setattr(boom, "add_token", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs[a][-1].error == "RuntimeError: x" and outs[a][-1].finish_reason == "abort"
    assert outs[b][-1].finish_reason == "length" and outs[b][-1].error is None
    assert len(outs[b]) == 4
    assert engine.kv.num_free_blocks == engine.num_kv_blocks


def test_a_failing_stat_logger_is_dropped_and_costs_no_output(tiny_llama_dir, caplog):
    """A broken logger (a step trace on a full disk) must not stop tokens from flowing."""
    import sloserve
    from sloserve.sampling_params import SamplingParams

    class Broken:
        calls = 0

        def record(self, it, finished):
            Broken.calls += 1
            raise OSError(28, "No space left on device")
    llm = sloserve.LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4)
    llm.engine.stat_loggers.append(Broken())
    out = llm.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.num_output_tokens == 6 and out.error is None
    assert Broken.calls == 1 and "stat logger Broken failed" in caplog.text


def test_an_int8_kv_cache_holds_twice_the_tokens_and_serves_the_embedded_model(llm):
    """``kv_cache_dtype="int8"``: 68 bytes per head and token (64 codes + a float32 scale), so a
    given memory holds 256/68 (float32) or 128/68 (bf16) times the tokens; the embedded model
    still answers greedily with the float32 cache's tokens on a plain prompt (checked: 16 of 16)."""
    import torch

    import sloserve
    eng8 = sloserve.LLM(model=None, dtype="float32", kv_cache_dtype="int8",
                        kv_cache_memory=0.05).engine
    cache = eng8.runner.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == 64 + 4
    per_token = 2 * 30 * 3 * 68
    assert eng8.runner.kv_bytes_per_token == per_token
    assert eng8.num_kv_blocks == int(0.05 * 1024 ** 3 // (16 * per_token))
    # the tensors allocated are exactly what the KV cache spec sized the cache with
    spec = eng8.core.kv_cache_spec
    assert spec.page_size_bytes == 16 * per_token
    assert sum(c.numel() * c.element_size() for c in eng8.runner.kv_caches) == \
        eng8.num_kv_blocks * spec.page_size_bytes == eng8.core.kv_cache_bytes
    sp = greedy(16, ignore_eos=True)
    ref = llm.generate([PROMPTS[0]], sp)[0].token_ids
    got = sloserve.LLM.__new__(sloserve.LLM)
    got.engine = eng8
    assert got.generate([PROMPTS[0]], sp)[0].token_ids == ref
    assert eng8.kv.num_free_blocks == eng8.num_kv_blocks
