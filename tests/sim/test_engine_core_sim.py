"""The simulator runs the engine core itself: EngineCore over the cost-model executor, on a
virtual clock the executor advances by each step's price; a mispriced step raises; the typed
prefill/decode entry (``kv_transfer_params``); the router sees a replica's step in flight."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest

from sloserve.bench.datasets import SampleRequest
from sloserve.engine.core import EngineCore
from sloserve.engine.messages import (EngineCoreRequest, KVTransferParams, decode_to_core,
                                      encoder)
from sloserve.sampling_params import SamplingParams
from sloserve.sim.cost_model import OverlapCostModel
from sloserve.sim.executor import SAMPLED_TOKEN_ID, CostModelExecutor, VirtualClock
from sloserve.sim.simulator import SimConfig, simulate_cluster


class _Price:
    def __init__(self, dt):
        self.dt = dt

    def step_time(self, comp):
        return self.dt


def _core(cost, cfg=None, raise_step_errors=True):
    cfg = cfg or SimConfig(max_num_batched_tokens=64, num_kv_blocks=32, block_size=16)
    clock = VirtualClock()
    steps = []
    ex = CostModelExecutor(cfg.engine_config(), cost, clock, cfg.max_model_len,
                           on_step=lambda end, comp: steps.append((end, comp)))
    core = EngineCore(ex.config, ex, scheduler_config=cfg, clock=clock,
                      raise_step_errors=raise_step_errors)
    return core, clock, steps


def _req(rid, prompt_len, max_tokens, kv=None):
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    return EngineCoreRequest(rid, list(range(1000, 1000 + prompt_len)), sp, arrival_time=0.0,
                             kv_transfer_params=kv)


def test_each_step_advances_the_virtual_clock_by_its_price():
    # 20 prompt tokens at 1000 tok/s under a 10 ms decode: 20 ms, then 10 ms per decode
    core, clock, steps = _core(OverlapCostModel(0.01, 1000.0))
    assert core.max_model_len == 8192  # the scheduler config's, over the 512-token cache
    core.add_request(_req("a", 20, 3))
    ends, tokens = [], []
    while core.has_unfinished_requests():
        outs = core.step()
        ends.append(outs.timestamp)
        assert outs.step.start_time == pytest.approx(ends[-1] - outs.step.step_s)
        tokens += [t for o in outs.outputs for t in o.new_token_ids]
    assert ends == pytest.approx([0.02, 0.03, 0.04])
    assert clock() == ends[-1]
    assert [e for e, _ in steps] == ends
    assert [c.prefill_chunks for _, c in steps] == [((20, 0),), (), ()]
    assert tokens == [SAMPLED_TOKEN_ID] * 3
    core.close()


def test_a_mispriced_step_raises_through_the_core_instead_of_failing_its_requests():
    core, _, _ = _core(_Price(0.0))
    core.add_request(_req("a", 8, 2))
    with pytest.raises(ValueError, match="priced a step at 0.0 s"):
        core.step()
    # the serving default: the step's requests fail and the loop goes on
    core, _, _ = _core(_Price(float("nan")), raise_step_errors=False)
    core.add_request(_req("a", 8, 2))
    (out,) = core.step().outputs
    assert out.finish_reason == "abort" and out.error.startswith("engine step failed: ValueError")
    assert not core.has_unfinished_requests()


def test_a_prefill_instance_checks_the_whole_request_and_runs_it_to_its_first_token():
    core, _, _ = _core(OverlapCostModel(0.01, 1000.0))
    with pytest.raises(ValueError, match="max_tokens 600"):  # 8 + 600 tokens > 512 cached
        core.add_request(_req("big", 8, 600, KVTransferParams(do_remote_decode=True)))
    core.add_request(_req("a", 8, 50, KVTransferParams(do_remote_decode=True)))
    (out,) = core.step().outputs
    assert out.new_token_ids == [SAMPLED_TOKEN_ID] and out.finish_reason == "length"
    assert not core.has_unfinished_requests()


def test_a_decode_instance_takes_the_prompt_kv_and_first_token_as_computed():
    core, _, steps = _core(OverlapCostModel(0.01, 1000.0))
    kv = KVTransferParams(num_computed_tokens=40, output_token_ids=[SAMPLED_TOKEN_ID])
    core.add_request(_req("a", 40, 4, kv))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step().outputs
    # no prefill: three decodes (the first computes the first token's KV, position 40) make
    # outputs 2..4
    assert [c.decode_contexts for _, c in steps] == [(41,), (42,), (43,)]
    assert not any(c.prefill_chunks for _, c in steps)
    assert outputs[-1].num_output_tokens == 4 and outputs[-1].finish_reason == "length"
    for bad in (41, -1):
        with pytest.raises(ValueError, match="num_computed_tokens must be in"):
            core.add_request(_req("b", 40, 4, KVTransferParams(num_computed_tokens=bad,
                                                               output_token_ids=[1])))


def test_kv_transfer_params_cross_the_process_boundary():
    req = _req("a", 3, 4, KVTransferParams(num_computed_tokens=3, output_token_ids=[7]))
    back = decode_to_core(encoder.encode(req))
    assert back.kv_transfer_params == req.kv_transfer_params
    assert decode_to_core(encoder.encode(_req("b", 3, 4))).kv_transfer_params is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"num_computed_tokens": "x"}, KVTransferParams)


def test_the_router_counts_the_requests_a_step_in_flight_finishes():
    """Request 0 takes replica 0 for one 1 s step that finishes it; request 1 arrives halfway:
    replica 0 still has one outstanding, so least-outstanding sends it to replica 1."""
    reqs = [SampleRequest("", 16, 1), SampleRequest("", 16, 1)]
    res = simulate_cluster(reqs, [0.0, 0.5], SimConfig(), OverlapCostModel(0.01, 16.0),
                           num_replicas=2, router="least-outstanding")
    assert res.replica_of == [0, 1]
    assert [r.ttft for r in res.records] == pytest.approx([1.0, 1.0])


def test_the_simulator_imports_no_torch():
    code = textwrap.dedent("""
        import sys
        from sloserve.bench.datasets import SampleRequest
        from sloserve.sim.cost_model import OverlapCostModel
        from sloserve.sim.simulator import SimConfig, simulate
        res = simulate([SampleRequest("", 16, 3)], [0.0], SimConfig(), OverlapCostModel(0.01, 1e3))
        print(res.records[0].output_tokens, "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "False"]
