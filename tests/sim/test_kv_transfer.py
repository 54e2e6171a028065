"""Prefill/decode disaggregation: the link model and the P/D simulation."""
from __future__ import annotations

import pytest

from sloserve.bench.arrivals import arrival_times
from sloserve.bench.datasets import mixed_workload
from sloserve.bench.metrics import calculate_metrics
from sloserve.sim.cost_model import OverlapCostModel
from sloserve.sim.kv_transfer import Disaggregation, KVTransferModel
from sloserve.sim.simulator import SimConfig, simulate_cluster
from sloserve.sim.workload import LengthOnlyFactory
from sloserve.workload import SampleRequest

MB = 1e6


def test_eager_exposes_the_whole_transfer_layerwise_hides_all_but_one_layer():
    link = KVTransferModel(kv_bytes_per_token=1 * MB, bandwidth=1000 * MB, num_layers=10,
                           mode="eager", latency_s=0.002)
    # 100 tokens = 100 MB over 1 GB/s = 0.1 s, after the prefill, plus the latency
    assert link.exposed_s(100, prefill_s=0.5) == pytest.approx(0.102)
    lw = KVTransferModel(1 * MB, 1000 * MB, 10, "layerwise")
    # compute per layer 0.05 s > transfer per layer 0.01 s: only the last layer's 0.01 s shows
    assert lw.exposed_s(100, prefill_s=0.5) == pytest.approx(0.01)
    # a link slower than compute: the pipeline is transfer-bound, 0.1 - 0.05 + 0.005 exposed
    assert lw.exposed_s(100, prefill_s=0.05) == pytest.approx(0.1 + 0.005 - 0.05)


@pytest.mark.parametrize("kw, msg", [
    ({"kv_bytes_per_token": 0}, "finite and > 0"), ({"num_layers": 0}, "finite and > 0"),
    ({"mode": "telepathy"}, "mode must be one of"), ({"latency_s": -1}, "latency")])
def test_link_model_rejects_bad_settings(kw, msg):
    args = {"kv_bytes_per_token": 1.0, "bandwidth": 1.0, "num_layers": 1, **kw}
    with pytest.raises(ValueError, match=msg):
        KVTransferModel(**args)
    with pytest.raises(ValueError, match=">= 1 prefill"):
        Disaggregation(0, 1, KVTransferModel(1.0, 1.0, 1))


def _run(dis=None, replicas=1, n=300, rate=4.0, policy="chunked"):
    reqs = mixed_workload(LengthOnlyFactory(), n, seed=0)
    arr = arrival_times(n, rate, seed=0)
    res = simulate_cluster(reqs, arr, SimConfig(max_num_batched_tokens=512, num_kv_blocks=100_000,
                                                policy=policy),
                           OverlapCostModel(0.022, 35000.0), replicas, record_steps=True,
                           disaggregation=dis)
    return reqs, res


def test_prefill_instances_only_prefill_decode_instances_only_decode():
    link = KVTransferModel(131072.0, 12.5e9, 32, "eager")  # Llama-3-8B KV over 100 Gbit/s
    reqs, res = _run(Disaggregation(1, 2, link))
    assert all(r.success and r.output_tokens == q.expected_output_len
               for r, q in zip(res.records, reqs))
    assert all(i == 0 for i in res.replica_of)  # the one prefill instance took every request
    for _, comp in res.steps:  # no step mixes the two phases
        assert not (comp.decode_contexts and comp.prefill_chunks)
    prefill = sum(n for _, c in res.steps for n, _ in c.prefill_chunks)
    decodes = sum(len(c.decode_contexts) for _, c in res.steps)
    assert prefill == sum(q.prompt_len for q in reqs)
    assert decodes == sum(q.expected_output_len - 1 for q in reqs)
    # the KV hand-off is the first inter-token gap: at least the exposed transfer time
    for q, r, x in zip(reqs, res.records, res.kv_transfer_s):
        assert x == pytest.approx(131072.0 * q.prompt_len / 12.5e9)
        assert r.itl[0] >= 0.022 + x - 1e-9
    assert len(res.kv_transfer_s) == len(reqs)


def test_disaggregation_removes_prefill_interference_from_tpot():
    """One colocated engine without chunking puts whole prefills into decode steps; with the
    phases apart every decode step is a pure memory-bound step (DistServe's motivation); what
    is left of TPOT beyond 22 ms is the hand-off: the transfer and the wait for a decode step."""
    _, colo = _run(replicas=1, rate=6.0, policy="naive")
    link = KVTransferModel(131072.0, 450e9, 32, "layerwise")  # NVLink: the hand-off is ~free
    _, dis = _run(Disaggregation(1, 1, link), rate=6.0, policy="naive")
    p99 = lambda r: calculate_metrics(r.records, r.duration).stats["tpot"].p(99)  # noqa: E731
    assert p99(colo) > 25.0
    assert 22.0 < p99(dis) < 23.0


def test_a_request_too_big_for_the_cluster_is_refused_before_any_prefill():
    link = KVTransferModel(1000.0, 1e9, 4)
    reqs = [SampleRequest("", 64, 200), SampleRequest("", 16, 8)]
    res = simulate_cluster(reqs, [0.0, 0.0], SimConfig(num_kv_blocks=8, block_size=16),
                           OverlapCostModel(0.01, 1e4), disaggregation=Disaggregation(1, 1, link))
    big, ok = res.records
    assert big.error.startswith("HTTP 400") and "max_tokens 200" in big.error
    assert big.chunk_times == [] and not big.success
    assert ok.success and ok.output_tokens == 8
