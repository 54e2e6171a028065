"""Per-request timing and aggregation through ``run_benchmark`` / ``send_request`` against the
scripted mock server (tests/bench/mock_server.py).

Scripted times are lower bounds of what the client measures (the server sleeps until each
offset after it received the request); a loaded host only delays chunks, so the tests check those
lower bounds and the exact definitions (TTFT, ITL, E2E from the content chunks' arrival times),
never an upper bound on time."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sloserve.bench.arrivals import arrival_times
from sloserve.bench.metrics import is_good
from sloserve.bench.request_func import RequestInput, send_request
from sloserve.bench.results import result_json
from sloserve.bench.runner import BenchConfig, BenchmarkError, run_benchmark
from sloserve.workload import SampleRequest

from .mock_server import MODEL_ID, Script, http_error, steady

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
WORKLOAD_PROMPT_LEN = 7  # the mock's usage reports prompt_tokens=5 unless a script says otherwise


def bench(mock, prompts, *, endpoint=COMPLETIONS, max_tokens=10, count_tokens=None, **kw):
    """run_benchmark over one request per prompt (all at once unless kw says otherwise)."""
    kw.setdefault("initial_test", False)
    cfg = BenchConfig(base_url=mock.base_url, model=MODEL_ID, endpoint=endpoint, progress=False, **kw)
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    reqs = [SampleRequest(p, WORKLOAD_PROMPT_LEN, mt, tag=f"tag{i}") for i, (p, mt) in enumerate(zip(prompts, mts))]
    return run_benchmark(cfg, reqs, count_tokens)


def send_one(mock, prompt, *, chat=False, max_tokens=10, count_tokens=None):
    async def go():
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            inp = RequestInput(url=mock.base_url + (CHAT if chat else COMPLETIONS), model=MODEL_ID,
                               prompt=prompt, prompt_len=WORKLOAD_PROMPT_LEN, max_tokens=max_tokens,
                               chat=chat)
            return await send_request(c, inp, count_tokens)

    return asyncio.run(go())


def assert_scripted(rec, offsets: list[float]) -> None:
    """The content chunks arrived no earlier than scripted, and TTFT / E2E / ITL are exactly what
    their arrival times define (one sample per content chunk, nothing else)."""
    ct = rec.chunk_times
    assert len(ct) == len(offsets)
    assert all(c - rec.send_time >= o for c, o in zip(ct, offsets)), (ct, rec.send_time)
    assert rec.ttft == ct[0] - rec.send_time and rec.latency == ct[-1] - rec.send_time
    assert rec.itl == [b - a for a, b in zip(ct, ct[1:])]


# --- the canonical timing script ---------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_ttft_500ms_then_9_gaps_of_20ms(mock_server, endpoint):
    prompt = mock_server.add(steady(0.5, 10, 0.02))  # + usage-only chunk, completion_tokens=10
    run = bench(mock_server, [prompt], endpoint=endpoint, max_tokens=10)
    (rec,) = run.records
    assert rec.success and rec.error == ""
    # a wrong definition (TTFT counted as a gap, the usage chunk as content) is off by a sample
    assert_scripted(rec, [0.5 + 0.02 * i for i in range(10)])
    assert len(rec.itl) == 9
    assert rec.output_tokens == 10
    assert rec.server_prompt_tokens == 5
    assert rec.prompt_len == 5  # the server's count wins over the workload's (as vLLM)
    assert rec.tpot == pytest.approx((rec.latency - rec.ttft) / 9, rel=1e-12)
    assert rec.generated_text == "".join(f" t{i}" for i in range(10))
    assert len(rec.chunk_times) == 10

    m = run.metrics
    assert (m.completed, m.failed, m.total_output, m.total_input) == (1, 0, 10, 5)
    assert m.stats["itl"].count == 9 and m.stats["ttft"].count == 1 and m.stats["tpot"].count == 1
    assert m.stats["ttft"].mean == pytest.approx(rec.ttft * 1e3, rel=1e-12)
    assert m.stats["tpot"].mean == pytest.approx(rec.tpot * 1e3, rel=1e-12)
    assert m.stats["itl"].median == pytest.approx(sorted(rec.itl)[4] * 1e3, rel=1e-12)
    assert m.stats["e2el"].mean == pytest.approx(rec.latency * 1e3, rel=1e-12)
    # the peak counts the chunks in the busiest whole second of the run (10 in one, on a quiet
    # host; a loaded one may split them over two)
    buckets = [int(t - run.start_time) for t in rec.chunk_times]
    assert m.max_output_tokens_per_s == max(buckets.count(b) for b in buckets)
    assert m.max_concurrent_requests == 1

    (path, body), = mock_server.bodies(prompt)
    assert path == endpoint
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 10 and body["model"] == MODEL_ID and body["temperature"] == 0.0
    if endpoint == CHAT:
        assert body["messages"] == [{"role": "user", "content": prompt}] and "prompt" not in body
    else:
        assert body["prompt"] == prompt and "messages" not in body


def test_early_stop_output_len_from_usage_and_tpot(mock_server):
    prompt = mock_server.add(steady(0.05, 20, 0.01))  # stops at 20 tokens
    run = bench(mock_server, [prompt], max_tokens=100)
    (rec,) = run.records
    assert rec.success
    assert rec.output_tokens == 20
    assert len(rec.itl) == 19
    assert rec.tpot == (rec.latency - rec.ttft) / 19
    assert run.metrics.stats["tpot"].mean == pytest.approx((rec.latency - rec.ttft) / 19 * 1e3, rel=1e-12)
    assert run.metrics.total_output == 20
    assert mock_server.bodies(prompt)[0][1]["max_tokens"] == 100
    assert result_json(run, detailed=True)["output_lens"] == [20]


# --- failures ----------------------------------------------------------------------------------

def test_http_500_and_in_stream_error_are_failed_not_good(mock_server):
    p500 = mock_server.add(http_error(500, "mock overloaded: KV cache full"))
    pstream = mock_server.add(Script(tokens=[(0.0, " a"), (0.01, " b")],
                                     stream_error=(0.02, "mock in-stream failure")))
    pok = mock_server.add(steady(0.0, 3, 0.005))
    run = bench(mock_server, [p500, pstream, pok], goodput={"ttft": 60_000.0, "e2el": 60_000.0})
    r500, rstream, rok = run.records

    assert not r500.success and r500.error.startswith("HTTP 500: ")
    assert json.loads(r500.error[len("HTTP 500: "):]) == {
        "error": {"message": "mock overloaded: KV cache full", "type": "InternalServerError",
                  "param": None, "code": 500}}
    assert not rstream.success and rstream.error == "mock in-stream failure"
    assert rok.success
    assert not is_good(r500, {"ttft": 60_000.0}) and not is_good(rstream, {"ttft": 60_000.0})

    m = run.metrics
    assert (m.completed, m.failed) == (1, 2)
    assert m.num_good == 1
    assert m.request_goodput == 1 / run.duration
    assert m.errors == {r500.error: 1, "mock in-stream failure": 1}
    assert "mock overloaded: KV cache full" in next(iter(k for k in m.errors if k.startswith("HTTP")))
    # failed requests count for nothing: only the good request's tokens and samples
    assert (m.total_input, m.total_output) == (5, 3)
    assert m.request_throughput == 1 / run.duration
    assert m.stats["ttft"].count == 1 and m.stats["itl"].count == 2
    d = result_json(run, detailed=True)
    assert d["errors"] == [r500.error, "mock in-stream failure", ""]
    assert d["output_lens"] == [0, 0, 3]


def test_initial_test_failure_raises_with_server_message(mock_server):
    p = mock_server.add(http_error(500, "mock says no"))
    with pytest.raises(BenchmarkError, match="mock says no"):
        bench(mock_server, [p], initial_test=True)
    assert len(mock_server.bodies(p)) == 1  # only the test request was sent
    assert mock_server.bodies(p)[0][1]["max_tokens"] == 2


def test_stream_without_content_is_a_failure(mock_server):
    p = mock_server.add(Script(tokens=[], usage=0))
    rec = send_one(mock_server, p)
    assert not rec.success
    assert rec.error == "the stream ended without any content"


# --- goodput -----------------------------------------------------------------------------------

def test_goodput_counts_only_requests_meeting_every_slo(mock_server):
    # a loaded host only delays chunks: a TTFT or E2E over its SLO by script stays over it, but
    # a good request can turn bad and a delayed first chunk shortens TPOT, so only the scripted
    # TTFT / E2E misses and the failure are checked one by one here (the verdict's exact logic is
    # tests/bench/test_metrics.py's); the counts must agree with the verdicts
    slos = {"ttft": 1000.0, "tpot": 200.0, "e2el": 1500.0}
    scripts = {
        "good": steady(0.05, 5, 0.01),           # ttft 50, tpot 10, e2el 90      -> good
        "slow_ttft": steady(1.5, 5, 0.01),       # ttft 1500                       -> bad
        "slow_tpot": steady(0.05, 4, 0.4),       # tpot 400                        -> bad
        "one_token": steady(0.05, 1, 0.0),       # tpot undefined, meets its SLO   -> good
        "failed": http_error(500, "mock goodput failure"),  #                      -> bad
        "slow_e2el": steady(0.05, 20, 0.1),      # tpot 100 but e2el 1950          -> bad
    }
    names = {k: mock_server.add(s) for k, s in scripts.items()}
    order = ["good", "slow_ttft", "good", "slow_tpot", "one_token", "failed", "good", "slow_tpot",
             "slow_ttft", "slow_e2el"]
    run = bench(mock_server, [names[k] for k in order], max_tokens=20, goodput=slos)
    verdicts = [is_good(r, slos) for r in run.records]
    assert not any(v for v, k in zip(verdicts, order) if k in ("slow_ttft", "failed", "slow_e2el"))
    m = run.metrics
    assert m.num_good == sum(verdicts) <= 4
    assert m.request_goodput == m.num_good / run.duration
    assert (m.completed, m.failed) == (9, 1)
    assert m.goodput_slos == slos
    # the undefined TPOT of the 1-token request is no sample
    assert m.stats["tpot"].count == 8
    # without SLOs there is no goodput
    assert bench(mock_server, [names["good"]]).metrics.request_goodput is None


# --- what is (not) a content chunk -------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_late_usage_chunk_and_empty_chunks_are_not_content(mock_server, endpoint):
    p = mock_server.add(steady(0.10, 5, 0.02, usage_at=0.40, empty_at=[0.0, 0.03, 0.13]))
    run = bench(mock_server, [p], endpoint=endpoint)
    (rec,) = run.records
    assert rec.success
    # neither the empty chunks (at 0 ms: no first token; at 130 ms: no gap) nor usage is content
    assert_scripted(rec, [0.10 + 0.02 * i for i in range(5)])
    assert len(rec.itl) == 4
    # E2E ends at the last content chunk, not at the usage chunk (400 ms), which came later
    assert run.duration >= 0.40
    assert rec.output_tokens == 5


def test_chat_role_only_first_chunk_is_not_content(mock_server):
    p = mock_server.add(Script(tokens=[(0.20, "Hel"), (0.22, "lo"), (0.24, "!")], usage=3, role_at=0.0))
    rec = send_one(mock_server, p, chat=True)
    assert rec.success
    assert_scripted(rec, [0.20, 0.22, 0.24])  # the role-only chunk at 0 ms is no first token
    assert len(rec.itl) == 2
    assert rec.generated_text == "Hello!"
    assert rec.output_tokens == 3


# --- output length without usage ---------------------------------------------------------------

def test_without_usage_output_tokens_come_from_count_tokens(mock_server):
    p = mock_server.add(steady(0.0, 6, 0.005, usage=None))
    seen = []

    def count(text):
        seen.append(text)
        return 17

    rec = send_one(mock_server, p, count_tokens=count)
    assert rec.success
    assert rec.output_tokens == 17
    assert seen == [" t0 t1 t2 t3 t4 t5"]
    assert rec.server_prompt_tokens is None
    assert rec.prompt_len == WORKLOAD_PROMPT_LEN  # no usage: the workload's count
    assert len(rec.itl) == 5
    # no callback either: the number of content chunks
    assert send_one(mock_server, p).output_tokens == 6


def test_usage_wins_over_count_tokens(mock_server):
    p = mock_server.add(steady(0.0, 6, 0.005, usage=9))
    rec = send_one(mock_server, p, count_tokens=lambda t: 17)
    assert rec.output_tokens == 9


# --- the schedule --------------------------------------------------------------------------------

def test_max_concurrency_serialises_requests(mock_server):
    p = mock_server.add(steady(0.03, 3, 0.02))
    run = bench(mock_server, [p] * 3, max_concurrency=1)
    recs = sorted(run.records, key=lambda r: r.send_time)
    for a, b in zip(recs, recs[1:]):
        assert b.send_time >= a.chunk_times[-1]
    # TTFT starts at the actual send, not at the due time (0 for all three): the later two
    # would count the whole wait for the slot otherwise
    for r in recs:
        assert_scripted(r, [0.03, 0.05, 0.07])
    # the wait for the slot is queue time, not TTFT: the first found one free (no wait at all),
    # each later one waited for the whole previous request (>= its scripted 70 ms), and no wait
    # is longer than the time from the run's start to the send
    q = [r.queue_time for r in recs]
    assert q[0] < q[1] and q[1] >= 0.07 and q[2] >= 0.14
    for r in recs:
        assert 0 <= r.queue_time <= r.send_time - run.start_time
    assert result_json(run)["queue_times"] == [r.queue_time for r in run.records]
    assert run.duration >= 3 * 0.07
    run = bench(mock_server, [p] * 3)
    assert [r.queue_time for r in run.records] == [0.0] * 3


def test_constant_rate_sends_on_schedule(mock_server):
    p = mock_server.add(steady(0.0, 2, 0.005))
    run = bench(mock_server, [p] * 4, request_rate=10.0, arrival="constant")
    # the schedule is 0.1 s apart; a send is never early, and a late event loop still sends
    # in the schedule's order (its timers fire by deadline)
    assert arrival_times(4, 10.0, process="constant") == pytest.approx([0.0, 0.1, 0.2, 0.3])
    starts = [r.send_time - run.start_time for r in run.records]
    assert all(got >= due for got, due in zip(starts, [0.0, 0.1, 0.2, 0.3])), starts
    assert starts == sorted(starts)
    d = result_json(run, detailed=True)
    assert d["start_times"] == [r.send_time for r in run.records]  # perf_counter clock, as vLLM
    assert d["request_rate"] == 10.0
    assert d["tags"] == ["tag0", "tag1", "tag2", "tag3"]


def test_trace_arrival_times_are_replayed(mock_server):
    p = mock_server.add(steady(0.0, 2, 0.005))
    cfg = BenchConfig(base_url=mock_server.base_url, model=MODEL_ID, initial_test=False, progress=False,
                      request_rate=1000.0)  # ignored: the trace has its own times
    reqs = [SampleRequest(p, 5, 4, arrival_time=t) for t in (0.0, 0.25, 0.1)]
    run = run_benchmark(cfg, reqs)
    starts = [r.send_time - run.start_time for r in run.records]
    assert all(got >= due for got, due in zip(starts, [0.0, 0.25, 0.1])), starts
    assert starts[0] < starts[2] < starts[1]  # the trace's order, not the list's


def test_connection_error_is_recorded_not_raised():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def go():
        async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
            return await send_request(c, RequestInput(url=f"http://127.0.0.1:{port}/v1/completions",
                                                      model="m", prompt="x", prompt_len=1, max_tokens=2))

    rec = asyncio.run(go())
    assert not rec.success
    assert rec.error.startswith("ConnectError")


def test_bench_config_validation(mock_server):
    with pytest.raises(ValueError, match="endpoint"):
        BenchConfig(base_url="http://x", model="m", endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="max concurrency"):
        BenchConfig(base_url="http://x", model="m", max_concurrency=0)
    assert BenchConfig(base_url="http://x:1/", model="m", endpoint=CHAT).url == "http://x:1/v1/chat/completions"
    with pytest.raises(ValueError, match="no requests"):
        run_benchmark(BenchConfig(base_url=mock_server.base_url, model=MODEL_ID, progress=False), [])


def test_a_requests_priority_is_sent_when_set():
    from sloserve.bench.runner import _inputs
    cfg = BenchConfig(base_url="http://127.0.0.1:1", model=MODEL_ID, initial_test=False,
                      progress=False, extra_body={"temperature": 0.5})
    a, b = _inputs(cfg, [SampleRequest("p", 1, 2, priority=2), SampleRequest("q", 1, 2)])
    assert a.body()["priority"] == 2 and a.body()["temperature"] == 0.5
    assert "priority" not in b.body() and cfg.extra_body == {"temperature": 0.5}


def test_ignore_priority_sends_none():
    from sloserve.bench.runner import _inputs
    cfg = BenchConfig(base_url="http://127.0.0.1:1", model=MODEL_ID, initial_test=False,
                      progress=False, ignore_priority=True)
    (a,) = _inputs(cfg, [SampleRequest("p", 1, 2, priority=2)])
    assert "priority" not in a.body()
