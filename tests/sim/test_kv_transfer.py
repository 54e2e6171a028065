"""Prefill/decode disaggregation: the link model and the P/D simulation."""
from __future__ import annotations

import pytest

from sloserve.bench.arrivals import arrival_times
from sloserve.bench.datasets import mixed_workload
from sloserve.bench.metrics import calculate_metrics
from sloserve.sim.cost_model import OverlapCostModel
from sloserve.sim.kv_transfer import Disaggregation, KVNetwork, KVTransferModel
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
    # the KV hand-off is the first inter-token gap: at least the exposed transfer time, which
    # is at least the transfer alone on the link (more where prompts left the one NIC together)
    alone = [131072.0 * q.prompt_len / 12.5e9 for q in reqs]
    for r, x, x1 in zip(res.records, res.kv_transfer_s, alone):
        assert x >= x1 * (1 - 1e-9)
        assert r.itl[0] >= 0.022 + x - 1e-9
    assert len(res.kv_transfer_s) == len(reqs)
    assert sum(x > x1 * 1.01 for x, x1 in zip(res.kv_transfer_s, alone)) > 10


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


def _eager(*transfers, p=2, d=2, bandwidth=1.0):
    """Eager transfers of (start time, key, prefill, decode, tokens) on a network of 1-byte
    tokens: {key: time its last byte left}."""
    net = KVNetwork(Disaggregation(p, d, KVTransferModel(1.0, bandwidth, 1, "eager")))
    done = {}
    for t, key, src, dst, n in transfers:
        done.update(net.advance(t))
        net.start(key, src, dst, n)
        net.prefill_done(key)
    done.update(net.advance(1e9))
    assert not net.transfers
    return done


def test_transfers_share_the_nics_max_min_fair():
    assert _eager((0.0, "a", 0, 0, 10)) == {"a": 10.0}  # alone: bytes / bandwidth
    # two leaving one prefill instance at once: half the rate each, both take twice as long
    assert _eager((0.0, "a", 0, 0, 10), (0.0, "b", 0, 1, 10)) == {"a": 20.0, "b": 20.0}
    # ... and two reaching one decode instance: the same on its NIC in
    assert _eager((0.0, "a", 0, 0, 10), (0.0, "b", 1, 0, 10)) == {"a": 20.0, "b": 20.0}
    assert _eager((0.0, "a", 0, 0, 10), (0.0, "b", 1, 1, 10)) == {"a": 10.0, "b": 10.0}
    # unequal: the short one ends at 2 x 4, the long one then has the NIC to itself
    assert _eager((0.0, "a", 0, 0, 10), (0.0, "b", 0, 1, 4)) == {"b": 8.0, "a": 14.0}
    # staggered: b starts when a is half sent; a's last half at half rate
    assert _eager((0.0, "a", 0, 0, 10), (5.0, "b", 1, 0, 10)) == {"a": 15.0, "b": 20.0}
    # max-min fair, not an even split: a1, a2, a3 meet on d1's NIC (1/3 each); a0 shares
    # p0's NIC with a1 only, so it takes the 2/3 that a1 cannot use
    assert _eager((0.0, "a0", 0, 0, 6), (0.0, "a1", 0, 1, 6), (0.0, "a2", 1, 1, 6),
                  (0.0, "a3", 1, 1, 6)) == pytest.approx({"a0": 9.0, "a1": 18.0, "a2": 18.0,
                                                          "a3": 18.0})


@pytest.mark.parametrize("prefill_s", [0.5, 0.1, 0.05])
def test_layerwise_alone_is_the_pipeline_and_two_share_its_rate(prefill_s):
    """Compute-bound (0.5 s), balanced and link-bound (0.05 s) pipelines of 10 layers: alone,
    the roofline's exposed time; two prompts prefilled in one step, what one alone exposes at
    half the bandwidth."""
    link = KVTransferModel(1 * MB, 1000 * MB, 10, "layerwise", latency_s=0.0)
    half = KVTransferModel(1 * MB, 500 * MB, 10, "layerwise")
    for keys, want in (((0,), link.exposed_s(100, prefill_s)),
                       ((0, 1), half.exposed_s(100, prefill_s))):
        net = KVNetwork(Disaggregation(1, 2, link))
        for k in keys:
            net.start(k, 0, k, 100)
            net.produced(k, 0, 100, 0.0, prefill_s)
        assert net.advance(prefill_s) == []  # the last layer is computed at the step's end
        for k in keys:
            net.prefill_done(k)
        assert [t - prefill_s for _, t in net.advance(10.0)] == pytest.approx([want] * len(keys))


def test_layerwise_sends_cached_positions_at_once_and_recomputed_ones_once():
    net = KVNetwork(Disaggregation(1, 1, KVTransferModel(1.0, 1.0, 1, "layerwise")))
    net.start("a", 0, 0, 100)
    net.produced("a", 60, 80, 0.0, 10.0)  # 60 prefix-cache hits sendable now, 20 at 10 s
    assert net.advance(10.0) == []
    net.produced("a", 0, 80, 10.0, 20.0)  # preempted and recomputed: nothing new
    net.produced("a", 80, 100, 20.0, 30.0)
    net.advance(30.0)
    net.prefill_done("a")
    assert net.advance(100.0) == [("a", 100.0)]  # the link never idled: 100 bytes at 1 B/s


def _pd(reqs, arrivals, link, blocks=100_000, p=1, d=1):
    return simulate_cluster(reqs, arrivals, SimConfig(num_kv_blocks=blocks, block_size=16),
                            OverlapCostModel(0.01, 1e4), disaggregation=Disaggregation(p, d, link))


def test_a_rate_on_the_command_line_is_the_link_and_two_transfers_share_it():
    from sloserve.roofline.kv import kv_bytes_per_token
    from sloserve.roofline.models import get_model
    from sloserve.sim.cli import _parser
    from sloserve.sim.setup import disaggregation_from_args
    a = _parser().parse_args(["--num-prefill-instances", "1", "--num-decode-instances", "1",
                              "--kv-transfer-link", "0.4gbit", "--kv-transfer-mode", "eager"])
    dis = disaggregation_from_args(a)
    kvb = kv_bytes_per_token(get_model("SmolLM2-135M"), "bf16")
    assert dis.link.bandwidth == 0.4e9 / 8 and dis.link.kv_bytes_per_token == kvb
    alone = 64 * kvb / 5e7  # one 64-token prompt's KV over 50 MB/s, latency 0
    res = _pd([SampleRequest("", 64, 4)], [0.0], dis.link)
    assert res.kv_transfer_s == [pytest.approx(alone, rel=1e-12)]
    # two prompts prefilled in one step leave the prefill instance's NIC together
    res = _pd([SampleRequest("", 64, 4)] * 2, [0.0, 0.0], dis.link, d=2)
    assert res.kv_transfer_s == [pytest.approx(2 * alone, rel=1e-12)] * 2
    assert all(r.success and r.itl[0] >= 2 * alone for r in res.records)


def test_a_slow_link_holds_prefill_blocks_and_delays_the_next_admission():
    """6 blocks of 16 on each instance. A (64 tokens, 4 blocks) is prefilled at once; its KV
    takes 1 s over the slow link, and the prefill instance holds its 4 blocks until then, so B
    (48 tokens, 3 blocks), arriving at 0.1 s, is admitted when A's transfer ends; over a fast
    link B is prefilled on arrival."""
    from sloserve.sim.simulator import _Cluster
    reqs, arrivals = [SampleRequest("", 64, 8), SampleRequest("", 48, 8)], [0.0, 0.1]
    prefill_b = 48 / 1e4
    fast = _pd(reqs, arrivals, KVTransferModel(1000.0, 1e9, 1, "eager"), blocks=6)
    assert fast.records[1].ttft == pytest.approx(prefill_b)
    slow_link = KVTransferModel(1000.0, 64_000.0, 1, "eager")
    c = _Cluster(reqs, arrivals, SimConfig(num_kv_blocks=6, block_size=16),
                 OverlapCostModel(0.01, 1e4), 1, "least-outstanding", False, None,
                 Disaggregation(1, 1, slow_link))
    slow = c.run()
    a_prefilled = slow.records[0].chunk_times[0]
    assert a_prefilled == pytest.approx(64 / 1e4) and slow.kv_transfer_s[0] == pytest.approx(1.0)
    assert slow.records[1].ttft == pytest.approx(a_prefilled + 1.0 - 0.1 + prefill_b)
    assert all(r.success and r.output_tokens == 8 for r in slow.records)
    assert slow.num_preemptions == 0
    prefill = c.front[0]
    assert not prefill.held and prefill.core.kv.num_free_blocks == 6  # every hold let go
