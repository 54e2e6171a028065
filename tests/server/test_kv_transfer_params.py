"""vLLM's ``kv_transfer_params`` in the API process: the request field's 400s against the session
server (which has no KV connector), ``GET /kv_transfer`` and the KV-transfer metrics there; the
typing of the object, the engine-role checks, the finished output's parameters in the response
and the metrics' feeding as unit tests (no server with a connector needed)."""
from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sloserve.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineInfo,
                                      KVTransferParams, SchedulerStats, StepStats)
from sloserve.engine.metrics import IterationStats
from sloserve.engine.output_processor import OutputProcessor
from sloserve.engine.outputs import RequestOutput
from sloserve.engine.processor import Processor, check_kv_transfer
from sloserve.sampling_params import ParamError, SamplingParams
from sloserve.server.logprobs_format import LogprobsFormatter
from sloserve.server.metrics import PrometheusStatLogger
from sloserve.server.protocol import (KV_TRANSFER_KEYS, ChatCompletionRequest,
                                      CompletionRequest, kv_transfer_params_from_json,
                                      kv_transfer_params_to_json)
from sloserve.server.serving import ChatBuilder, Choice, ChoiceState, CompletionBuilder

PREFILL = {"do_remote_decode": True}
NEEDS_CONNECTOR = "kv_transfer_params needs a server started with --kv-transfer-config"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _bad_request(r, message: str, param: str | None) -> None:
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "BadRequestError",
                                  "param": param, "code": 400}}


def _refused(name: str) -> str:
    return f"{name} is not supported with kv_transfer_params (disaggregated prefill/decode) yet"


# ------------------------------------------------------------------- the server without one
@pytest.mark.parametrize("kv", [PREFILL, {"do_remote_prefill": True, "transfer_id": "t"}, {}])
def test_refused_without_a_connector(http, kv):
    body = {"kv_transfer_params": kv, "max_tokens": 1}
    _bad_request(http.post("/v1/completions", json={**body, "prompt": "Hi"}),
                 NEEDS_CONNECTOR, "kv_transfer_params")
    _bad_request(http.post("/v1/chat/completions", json={**body, "messages": MESSAGES}),
                 NEEDS_CONNECTOR, "kv_transfer_params")


def test_null_is_no_kv_transfer_params_and_the_response_says_null(http):
    body = {"kv_transfer_params": None, "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/completions", json={**body, "prompt": "Hi"})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
    r = http.post("/v1/chat/completions", json={**body, "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
    with http.stream("POST", "/v1/completions",
                     json={**body, "prompt": "Hi", "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines()
                  if ln.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("kv_transfer_params" not in c for c in chunks)


@pytest.mark.parametrize("extra, message, param", [
    ({"n": 2}, "n must be 1 with kv_transfer_params, got 2", "n"),
    ({"logprobs": 0}, _refused("logprobs"), "logprobs"),
    ({"prompt_logprobs": 1}, _refused("prompt_logprobs"), "prompt_logprobs"),
    ({"echo": True}, _refused("echo"), "echo"),
    ({"response_format": {"type": "json_object"}}, _refused("response_format"),
     "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, _refused("structured_outputs"),
     "structured_outputs"),
    ({"guided_json": {"type": "object"}}, _refused("guided_json"), "guided_json"),
    ({"prompt": ["a", "b"]}, "kv_transfer_params takes one prompt, got 2", "prompt"),
])
def test_completions_fields_not_served_with_it(http, extra, message, param):
    body = {"prompt": "Hi", "max_tokens": 1, "kv_transfer_params": PREFILL, **extra}
    _bad_request(http.post("/v1/completions", json=body), message, param)


@pytest.mark.parametrize("extra, message, param", [
    ({"n": 3}, "n must be 1 with kv_transfer_params, got 3", "n"),
    ({"logprobs": True}, _refused("logprobs"), "logprobs"),
    ({"logprobs": True, "top_logprobs": 2}, _refused("logprobs"), "logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     _refused("response_format"), "response_format"),
    ({"guided_regex": "a+"}, _refused("guided_regex"), "guided_regex"),
])
def test_chat_fields_not_served_with_it(http, extra, message, param):
    body = {"messages": MESSAGES, "max_tokens": 1, "kv_transfer_params": PREFILL, **extra}
    _bad_request(http.post("/v1/chat/completions", json=body), message, param)


def test_fields_off_pass_the_field_checks(http):
    """Off values (logprobs null, echo false, text format, n 1, a null guided_*) reach the
    connector check."""
    body = {"prompt": "Hi", "max_tokens": 1, "kv_transfer_params": PREFILL, "n": 1,
            "logprobs": None, "echo": False, "response_format": {"type": "text"},
            "guided_json": None}
    _bad_request(http.post("/v1/completions", json=body), NEEDS_CONNECTOR, "kv_transfer_params")
    body = {"messages": MESSAGES, "max_tokens": 1, "kv_transfer_params": PREFILL,
            "logprobs": False}
    _bad_request(http.post("/v1/chat/completions", json=body), NEEDS_CONNECTOR,
                 "kv_transfer_params")


KNOWN = ("known: do_remote_decode, do_remote_prefill, transfer_id, remote_engine_id, "
         "remote_host, remote_port, remote_block_ids")
BAD_OBJECTS = [
    ({"do_remote_decode": True, "tp_size": 1},
     f"kv_transfer_params: unknown key 'tp_size' ({KNOWN})"),
    ({"num_computed_tokens": 5},
     "kv_transfer_params.num_computed_tokens is set by the engine, not by API clients"),
    ({"output_token_ids": [1]},
     "kv_transfer_params.output_token_ids is set by the engine, not by API clients"),
    ({"do_remote_decode": "yes"},
     "kv_transfer_params.do_remote_decode: Expected `bool`, got `str`"),
    ({"do_remote_prefill": 1}, "kv_transfer_params.do_remote_prefill: Expected `bool`, got `int`"),
    ({"remote_port": True}, "kv_transfer_params.remote_port: Expected `int | null`, got `bool`"),
    ({"remote_port": 70000}, "kv_transfer_params.remote_port must be in [1, 65535], got 70000"),
    ({"remote_block_ids": [1, -2]},
     "kv_transfer_params.remote_block_ids must be integers in [0, 2**63)"),
    ({"remote_block_ids": [1, 2.5]},
     "kv_transfer_params.remote_block_ids: Expected `int`, got `float` - at `$[1]`"),
    ({"transfer_id": ""}, "kv_transfer_params.transfer_id must be a non-empty string"),
    ({"remote_host": 5}, "kv_transfer_params.remote_host: Expected `str | null`, got `int`"),
    ({"remote_host": "a\u0000b"}, "kv_transfer_params.remote_host must be a host name or an IP "
     "address (at most 253 characters of letters, digits and .-:_[]%), got 'a\\x00b'"),
    ({"do_remote_decode": True, "do_remote_prefill": True},
     "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true"),
]


@pytest.mark.parametrize("kv, message", BAD_OBJECTS)
def test_bad_objects_name_the_key(http, kv, message):
    body = {"prompt": "Hi", "max_tokens": 1, "kv_transfer_params": kv}
    _bad_request(http.post("/v1/completions", json=body), message, "kv_transfer_params")


def test_bad_object_on_chat_too(http):
    body = {"messages": MESSAGES, "max_tokens": 1, "kv_transfer_params": {"remote_port": "x"}}
    _bad_request(http.post("/v1/chat/completions", json=body),
                 "kv_transfer_params.remote_port: Expected `int | null`, got `str`",
                 "kv_transfer_params")


def test_not_an_object(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "kv_transfer_params": [1]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"
    assert r.json()["error"]["message"] == (
        "1 validation error: kv_transfer_params: Input should be a valid dictionary")


def test_kv_transfer_route_is_404_without_a_connector(http):
    r = http.get("/kv_transfer")
    assert r.status_code == 404
    assert r.json() == {"error": {
        "message": "this server has no KV connector (start it with --kv-transfer-config)",
        "type": "NotFoundError", "param": None, "code": 404}}


def test_metrics_exist_at_zero_without_a_connector(http, live_server):
    lines = http.get("/metrics").text.splitlines()
    m = f'model_name="{live_server.model}"'
    for line in (f'sloserve:kv_transfer_bytes_total{{direction="sent",{m}}} 0.0',
                 f'sloserve:kv_transfer_bytes_total{{direction="received",{m}}} 0.0',
                 f'sloserve:kv_transfer_failures_total{{{m}}} 0.0',
                 f'sloserve:num_requests_waiting_for_kv{{{m}}} 0.0',
                 f'sloserve:kv_transfer_seconds_count{{{m}}} 0.0'):
        assert line in lines, line


# ------------------------------------------------------------------------------ unit tests
def test_every_client_key_converts():
    obj = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_engine_id": "e",
           "remote_host": "10.0.0.2", "remote_port": 14579, "remote_block_ids": [3, 4]}
    assert tuple(KV_TRANSFER_KEYS) == ("do_remote_decode", "do_remote_prefill", "transfer_id",
                                       "remote_engine_id", "remote_host", "remote_port",
                                       "remote_block_ids")
    assert kv_transfer_params_from_json(obj) == KVTransferParams(
        do_remote_prefill=True, transfer_id="t-1", remote_engine_id="e", remote_host="10.0.0.2",
        remote_port=14579, remote_block_ids=[3, 4])
    assert kv_transfer_params_from_json({"transfer_id": None}) == KVTransferParams()


def test_request_models_give_the_typed_params():
    r = CompletionRequest(prompt=[[1, 2]], kv_transfer_params=PREFILL)
    r.unsupported()
    assert r.kv_transfer() == KVTransferParams(do_remote_decode=True)
    assert CompletionRequest(prompt="x").kv_transfer() is None
    c = ChatCompletionRequest(messages=MESSAGES, kv_transfer_params={"do_remote_prefill": True})
    c.unsupported()
    assert c.kv_transfer() == KVTransferParams(do_remote_prefill=True)


def test_response_json_omits_defaults():
    kv = KVTransferParams(do_remote_prefill=True, transfer_id="t", remote_block_ids=[7])
    assert kv_transfer_params_to_json(kv) == {"do_remote_prefill": True, "transfer_id": "t",
                                              "remote_block_ids": [7]}
    assert kv_transfer_params_to_json(None) is None


def _info(role: str | None, mode: str = "pull") -> EngineInfo:
    return EngineInfo(model_name="m", model_path="p", max_model_len=64, vocab_size=100,
                      eos_token_ids=[0], num_kv_blocks=16, block_size=16,
                      max_num_batched_tokens=64, dtype="float32", kv_cache_dtype="float32",
                      kv_role=role, kv_engine_id="e1" if role else None,
                      kv_host="127.0.0.1" if role else None, kv_port=14579 if role else None,
                      kv_mode=mode if role else None)


DECODE = KVTransferParams(do_remote_prefill=True, transfer_id="t", remote_host="10.0.0.1",
                          remote_port=14579)


@pytest.mark.parametrize("role, kv, message", [
    (None, KVTransferParams(), NEEDS_CONNECTOR),
    ("kv_consumer", KVTransferParams(do_remote_decode=True),
     "kv_transfer_params.do_remote_decode (a prefill request) needs a kv_producer or kv_both "
     "server; this one is kv_consumer"),
    ("kv_producer", DECODE,
     "kv_transfer_params.do_remote_prefill (a decode request) needs a kv_consumer or kv_both "
     "server; this one is kv_producer"),
    ("kv_both", KVTransferParams(do_remote_decode=True, do_remote_prefill=True),
     "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true"),
    ("kv_consumer", KVTransferParams(do_remote_prefill=True, transfer_id="t",
                                     remote_host="10.0.0.1"),
     "kv_transfer_params.do_remote_prefill needs remote_host and remote_port (the prefill "
     "instance's KV connector) in pull mode"),
    ("kv_consumer", KVTransferParams(do_remote_prefill=True, remote_host="10.0.0.1",
                                     remote_port=1),
     "kv_transfer_params.do_remote_prefill needs transfer_id (the prefill instance's response "
     "gives it)"),
])
def test_engine_role_refusals(role, kv, message):
    with pytest.raises(ParamError) as e:
        check_kv_transfer(kv, _info(role))
    assert str(e.value) == message and e.value.param == "kv_transfer_params"


@pytest.mark.parametrize("role, kv", [
    ("kv_producer", KVTransferParams(do_remote_decode=True)), ("kv_consumer", DECODE),
    ("kv_both", KVTransferParams(do_remote_decode=True)), ("kv_both", DECODE),
    ("kv_producer", KVTransferParams()),
])
def test_processor_passes_served_params_on(role, kv):
    req = Processor(None, _info(role)).make_request([5, 6, 7], SamplingParams(max_tokens=4),
                                                    "r1", kv_transfer_params=kv)
    assert req.kv_transfer_params == kv
    with pytest.raises(ParamError, match="^kv_transfer_params needs a server started"):
        Processor(None, _info(None)).make_request([5], SamplingParams(max_tokens=4),
                                                  kv_transfer_params=kv)


def test_push_mode_decode_needs_no_remote_address():
    check_kv_transfer(KVTransferParams(do_remote_prefill=True, transfer_id="t"),
                      _info("kv_consumer", "push"))


def _step() -> StepStats:
    return StepStats(start_time=0.0, step_s=0.01, forward_s=0.01, num_batched_tokens=1,
                     num_prefill_tokens=0, num_decode_tokens=1, num_generation_tokens=1,
                     num_preemptions=0, kv_cache_usage=0.1)


def test_output_processor_hands_on_the_finished_params_and_transfer_times():
    op = OutputProcessor(None)
    info = _info("kv_both")
    proc = Processor(None, info)
    back = KVTransferParams(do_remote_prefill=True, transfer_id="p", remote_host="h",
                            remote_port=9, remote_block_ids=[0])
    op.add_request(proc.make_request([1, 2], SamplingParams(max_tokens=4), "p",
                                     kv_transfer_params=KVTransferParams(do_remote_decode=True)))
    op.add_request(proc.make_request([1, 2], SamplingParams(max_tokens=4), "d",
                                     kv_transfer_params=DECODE))
    # a message without a step: the decode request's KV arrived; its time waits for a step
    res = op.process_outputs(EngineCoreOutputs(
        [EngineCoreOutput("d", [5], num_output_tokens=1, kv_transfer_s=0.25)],
        SchedulerStats()), now=1.0)
    assert res.iteration is None
    assert res.request_outputs[0][1].kv_transfer_params is None
    res = op.process_outputs(EngineCoreOutputs(
        [EngineCoreOutput("p", [9], finish_reason="length", num_output_tokens=1,
                          kv_transfer_params=back),
         EngineCoreOutput("d", [6], num_output_tokens=2)],
        SchedulerStats(), step=_step()), now=2.0)
    outs = {o.request_id: o for _, o in res.request_outputs}
    assert outs["p"].finished and outs["p"].kv_transfer_params == back
    assert not outs["d"].finished and outs["d"].kv_transfer_params is None
    assert res.iteration.kv_transfer_s == [0.25]
    res = op.process_outputs(EngineCoreOutputs(
        [EngineCoreOutput("d", [7], num_output_tokens=3)], SchedulerStats(), step=_step()),
        now=3.0)
    assert res.iteration.kv_transfer_s == []


def _finished_state(kv: KVTransferParams | None) -> tuple[ChoiceState, RequestOutput]:
    """A finished prefill choice whose last output carries ``kv``."""
    req = Processor(None, _info("kv_producer")).make_request(
        [1, 2], SamplingParams(max_tokens=4), "r",
        kv_transfer_params=KVTransferParams(do_remote_decode=True))
    st = ChoiceState(Choice(req), 0)
    out = RequestOutput("r", "Hi", [9], "Hi", [9], finished=True, finish_reason="length",
                        num_prompt_tokens=2, num_output_tokens=1, kv_transfer_params=kv)
    st.started = True
    st.add(out)
    return st, out


BACK = KVTransferParams(do_remote_prefill=True, transfer_id="r", remote_engine_id="e1",
                        remote_host="127.0.0.1", remote_port=14579, remote_block_ids=[0])
BACK_JSON = {"do_remote_prefill": True, "transfer_id": "r", "remote_engine_id": "e1",
             "remote_host": "127.0.0.1", "remote_port": 14579, "remote_block_ids": [0]}


@pytest.mark.parametrize("builder", [CompletionBuilder, ChatBuilder])
def test_responses_carry_the_params_top_level(builder):
    b = builder("id-1", 1, "m", LogprobsFormatter(None))
    st, out = _finished_state(BACK)
    whole = b.response([st]).model_dump()
    assert whole["kv_transfer_params"] == BACK_JSON
    assert "kv_transfer_params" not in whole["choices"][0]
    last = json.loads(b.chunk(st, out, False)[len("data: "):])
    assert last["kv_transfer_params"] == BACK_JSON
    assert last["choices"][0]["finish_reason"] == "length"
    usage = json.loads(b.usage_chunk(b.response([st]).usage)[len("data: "):])
    assert "kv_transfer_params" not in usage


@pytest.mark.parametrize("builder", [CompletionBuilder, ChatBuilder])
def test_responses_without_params(builder):
    b = builder("id-1", 1, "m", LogprobsFormatter(None))
    st, out = _finished_state(None)
    assert b.response([st]).model_dump()["kv_transfer_params"] is None
    assert "kv_transfer_params" not in json.loads(b.chunk(st, out, False)[len("data: "):])
    mid = RequestOutput("r", "a", [3], "a", [3])  # not finished: no parameters yet
    assert "kv_transfer_params" not in json.loads(b.chunk(st, mid, False)[len("data: "):])


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_follow_the_core_totals_and_transfer_times():
    m = PrometheusStatLogger(model_name="m", max_model_len=64)
    m.set_kv_transfer(2, 1000, 300, 1)
    m.set_kv_transfer(1, 1500, 300, 3)
    m.record(IterationStats(kv_transfer_s=[0.003, 0.2]), [])
    s = _samples(m.render().decode())
    lbl = (("model_name", "m"),)
    assert s[("sloserve:kv_transfer_bytes_total", (("direction", "sent"), *lbl))] == 1500
    assert s[("sloserve:kv_transfer_bytes_total", (("direction", "received"), *lbl))] == 300
    assert s[("sloserve:kv_transfer_failures_total", lbl)] == 3
    assert s[("sloserve:num_requests_waiting_for_kv", lbl)] == 1
    assert s[("sloserve:kv_transfer_seconds_count", lbl)] == 2
    assert s[("sloserve:kv_transfer_seconds_sum", lbl)] == pytest.approx(0.203)
    assert s[("sloserve:kv_transfer_seconds_bucket", (("le", "0.005"), *lbl))] == 1
    m.set_kv_transfer(0, 10, 0, 0)  # a new core: its totals are the new base
    m.set_kv_transfer(0, 30, 5, 0)
    s = _samples(m.render().decode())
    assert s[("sloserve:kv_transfer_bytes_total", (("direction", "sent"), *lbl))] == 1520
    assert s[("sloserve:kv_transfer_bytes_total", (("direction", "received"), *lbl))] == 305
