"""The KV connector (prefill/decode disaggregation) between two in-process engine cores over
TCP on 127.0.0.1: greedy float32 output of P + D identical to one engine alone for push/pull x
eager/layer-wise x full/incremental, the exact bytes on the socket, a decode side that decodes
from what arrived, failures and timeouts that free every block on both sides."""
from __future__ import annotations

import time

import pytest

from sloserve.config import EngineConfig, KVTransferConfig
from sloserve.engine.core import EngineCore
from sloserve.engine.messages import EngineCoreRequest, KVTransferParams
from sloserve.sampling_params import SamplingParams

from .conftest import check_kv_invariants

#: 37 tokens: 10 blocks of 4, the last one partly filled; chunks of 10 end mid-block
PROMPT = [11 + 5 * j for j in range(37)]
SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
#: D has these 5 blocks cached before the P/D request comes (incremental skips them)
PREFIX = PROMPT[:20] + [7, 8, 9]


def _config(model, role=None, kv_load_failure_policy="recompute", **extra) -> EngineConfig:
    kv = None
    if role is not None:
        kv = {"kv_role": role, "kv_port": 0, "kv_load_failure_policy": kv_load_failure_policy,
              "kv_connector_extra_config": {"timeout_s": 20, **extra}}
    return EngineConfig(model=model, dtype="float32", num_kv_blocks=64, block_size=4,
                        max_num_batched_tokens=10, kv_transfer_config=kv)


def _drive(cores, until_finished: str | None = None, deadline_s: float = 60.0) -> dict[str, list]:
    """Step the cores in turn until none has work (or request ``until_finished`` finished);
    every output per request id."""
    outs: dict[str, list] = {}
    t = time.monotonic()
    while any(c.has_unfinished_requests() for c in cores):
        if until_finished and any(o.finished for o in outs.get(until_finished, ())):
            break
        for c in cores:
            if c.has_unfinished_requests():
                o = c.step()
                for x in (o.outputs if o else ()):
                    outs.setdefault(x.request_id, []).append(x)
        time.sleep(0.0005)
        assert time.monotonic() - t < deadline_s, "the cores did not finish (a stuck transfer)"
    return outs


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _all_free(*cores) -> None:
    for c in cores:
        assert c.kv.num_free_blocks == c.num_kv_blocks
        check_kv_invariants(c.scheduler)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, single_thread):
    core = EngineCore(_config(tiny_llama_dir))
    core.add_request(EngineCoreRequest("ref", PROMPT, SP, 0.0))
    toks = _tokens(_drive([core])["ref"])
    core.close()
    return toks


def _pair(model, mode, granularity, incremental, policy="recompute", timeout_s=20):
    p = EngineCore(_config(model, "kv_producer", mode=mode, granularity=granularity,
                           timeout_s=timeout_s))
    d_cfg = _config(model, "kv_consumer", mode=mode, incremental=incremental,
                    timeout_s=timeout_s)
    d_cfg.kv_transfer_config["kv_load_failure_policy"] = policy
    return p, EngineCore(d_cfg)


def _params(p, d, mode, tid="t1"):
    """The concurrent flow's two halves (the router's job)."""
    pk = KVTransferParams(do_remote_decode=True, transfer_id=tid)
    dk = KVTransferParams(do_remote_prefill=True, transfer_id=tid)
    if mode == "push":
        pk.remote_host, pk.remote_port = "127.0.0.1", d.info.kv_port
    else:
        dk.remote_host, dk.remote_port = "127.0.0.1", p.info.kv_port
    return pk, dk


def _block_bytes(core) -> int:
    """KV bytes of one block over all layers."""
    return core.kv_cache_spec.page_size_bytes


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("granularity", ["layerwise", "eager"])
@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "full"])
def test_pd_output_equals_colocated_and_sends_exactly_the_missing_blocks(
        tiny_llama_dir, reference, mode, granularity, incremental):
    p, d = _pair(tiny_llama_dir, mode, granularity, incremental)
    try:
        # D caches 5 blocks of the prompt first (a request of its own)
        d.add_request(EngineCoreRequest("warm", PREFIX, SamplingParams(max_tokens=1), 0.0))
        _drive([d])
        pk, dk = _params(p, d, mode)
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        steps = []
        outs = _drive([p, d])
        assert _tokens(outs["d"]) == reference
        assert _tokens(outs["p"]) == reference[:1]  # P samples the first token, once
        assert outs["d"][0].new_token_ids == reference[:1] and outs["d"][0].kv_transfer_s > 0
        cached = 5 if incremental else 0
        blocks = -(-len(PROMPT) // 4)
        sent = p.stats().kv_transfer_bytes_sent_total
        assert sent == (blocks - cached) * _block_bytes(p)
        assert d.stats().kv_transfer_bytes_received_total == sent
        assert outs["d"][0].num_cached_tokens == 4 * cached
        _all_free(p, d)
        del steps
    finally:
        p.close()
        d.close()


def test_decode_side_runs_only_decodes_and_decodes_from_what_arrived(tiny_llama_dir,
                                                                      reference):
    p, d = _pair(tiny_llama_dir, "pull", "layerwise", False)
    try:
        pk, dk = _params(p, d, "pull")
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        prefill_tokens, decode_steps = 0, []
        t = time.monotonic()
        toks = []
        while p.has_unfinished_requests() or d.has_unfinished_requests():
            if p.has_unfinished_requests():
                p.step()
            o = d.step() if d.has_unfinished_requests() else None
            if o is not None:
                toks += [t for x in o.outputs for t in x.new_token_ids]
                if o.step is not None:
                    prefill_tokens += o.step.num_prefill_tokens
                    decode_steps.append(o.step.num_decode_tokens)
            time.sleep(0.0005)
            assert time.monotonic() - t < 60
        assert toks == reference
        assert prefill_tokens == 0 and decode_steps == [1] * (SP.max_tokens - 1)
        _all_free(p, d)

        # now corrupt what arrives: D decodes from it, so its output changes
        def flip(buf: bytearray) -> None:
            for i in range(0, len(buf), 7):
                buf[i] ^= 0x5A
        d.runner.kv_connector.on_receive = flip
        pk, dk = _params(p, d, "pull", tid="t2")
        p.add_request(EngineCoreRequest("p2", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d2", PROMPT, SP, 0.0, kv_transfer_params=dk))
        outs = _drive([p, d])
        assert _tokens(outs["d2"])[0] == reference[0]  # the first token came from P
        assert _tokens(outs["d2"]) != reference
        _all_free(p, d)
    finally:
        p.close()
        d.close()


def test_serial_flow_prefill_response_carries_the_decode_sides_parameters(tiny_llama_dir,
                                                                          reference):
    """vLLM's proxy flow: P first (its response names the transfer and P's connector),
    then D with those parameters, pulling."""
    p, d = _pair(tiny_llama_dir, "pull", "eager", True)
    try:
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0,
                                        kv_transfer_params=KVTransferParams(do_remote_decode=True)))
        outs = _drive([p], until_finished="p")
        last = outs["p"][-1]
        params = last.kv_transfer_params
        assert last.finish_reason == "length" and params is not None
        assert (params.do_remote_prefill, params.transfer_id, params.remote_port) == \
            (True, "p", p.info.kv_port)
        assert p.kv.num_free_blocks < p.num_kv_blocks  # held for the reader
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=params))
        outs = _drive([d], until_finished="d")
        assert _tokens(outs["d"]) == reference
        last = None  # P frees the blocks it held without a step, and says so (its gauges)
        t = time.monotonic()
        while p.has_unfinished_requests():
            last = p.step() or last
            assert time.monotonic() - t < 60
        assert last is not None and last.scheduler_stats.num_waiting_for_kv == 0
        assert last.scheduler_stats.kv_cache_usage == 0
        _all_free(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_side_gone_mid_transfer(tiny_llama_dir, reference, policy):
    """P dies after a layer went: D frees its blocks and prefills the request itself
    (``recompute``) or fails it (``fail``)."""
    p, d = _pair(tiny_llama_dir, "pull", "layerwise", False, policy=policy)
    try:
        pk, dk = _params(p, d, "pull")
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        p.step()  # P's first chunk: its two full blocks go, layer by layer; P stops there
        t = time.monotonic()
        while d.stats().kv_transfer_bytes_received_total == 0:  # some KV has arrived
            d.step()
            time.sleep(0.001)
            assert time.monotonic() - t < 60
        p.close()  # its connector stops: the connection drops
        outs = _drive([d])
        if policy == "recompute":
            assert _tokens(outs["d"]) == reference
        else:
            assert outs["d"][-1].finish_reason == "abort"
            assert "KV transfer failed" in outs["d"][-1].error
        assert d.stats().kv_transfer_failures_total == 1
        _all_free(d)
    finally:
        d.close()


def test_decode_side_gone_and_nobody_pulling_free_the_prefill_sides_blocks(tiny_llama_dir):
    """D's connection drops during a push: P frees the request's blocks once it finishes;
    a serial-flow prefill nobody pulls is freed after ``timeout_s``."""
    p, d = _pair(tiny_llama_dir, "push", "layerwise", False, timeout_s=1)
    try:
        pk, _ = _params(p, d, "push")
        d.close()  # nobody listens at D's port any more: the push cannot connect
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        _drive([p])
        assert p.stats().kv_transfer_failures_total == 1
        _all_free(p)
        p.add_request(EngineCoreRequest("s", PROMPT, SP, 0.0,
                                        kv_transfer_params=KVTransferParams(do_remote_decode=True)))
        outs = _drive([p])  # held 1 s for a reader that never comes, then freed
        assert outs["s"][-1].kv_transfer_params is not None
        assert p.stats().kv_transfer_failures_total == 2
        _all_free(p)
    finally:
        p.close()


def test_serial_prefill_ended_by_its_first_token_is_not_held(tiny_llama_dir, reference):
    p = EngineCore(_config(tiny_llama_dir, "kv_producer"))
    try:
        stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=reference[:1])
        p.add_request(EngineCoreRequest("s", PROMPT, stop, 0.0,
                                        kv_transfer_params=KVTransferParams(do_remote_decode=True)))
        outs = _drive([p])  # ends at once: nothing held for 20 s
        assert outs["s"][-1].finish_reason == "stop"
        assert outs["s"][-1].kv_transfer_params is None
        _all_free(p)
    finally:
        p.close()


def test_a_load_past_timeout_fails_with_the_limit_named(tiny_llama_dir):
    """P never registers the transfer (no such request there): D's load is cancelled after
    timeout_s and, under ``fail``, the request fails naming the limit."""
    p, d = _pair(tiny_llama_dir, "pull", "layerwise", False, policy="fail", timeout_s=1)
    try:
        _, dk = _params(p, d, "pull", tid="nobody")
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        outs = _drive([d])
        assert outs["d"][-1].finish_reason == "abort"
        assert outs["d"][-1].error == "KV transfer failed: no KV within timeout_s=1"
        assert d.stats().kv_transfer_failures_total >= 1
        _all_free(d)
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1:"):
            port = p.info.kv_port  # taken by P
            cfg = _config(tiny_llama_dir, "kv_consumer")
            cfg.kv_transfer_config["kv_port"] = port
            EngineCore(cfg)
    finally:
        p.close()
        d.close()


def test_abort_while_loading_frees_after_the_worker_stops(tiny_llama_dir):
    p, d = _pair(tiny_llama_dir, "pull", "layerwise", False)
    try:
        _, dk = _params(p, d, "pull")
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        assert not d.prewarm_for_remote_kv(0, 4)  # nothing loading: nothing to warm for
        d.step()  # admitted: holds its blocks, connected to P, waiting (P has no such request)
        assert d.stats().num_waiting_for_kv == 1 and d.kv.num_free_blocks < d.num_kv_blocks
        # idle with a prompt's KV on its way: the core loop reads the decode weights part by
        # part (every part of them, whatever the model's weights are)
        assert d.waits_only_for_transfers()
        assert all(d.prewarm_for_remote_kv(i, 4) for i in range(4))
        outs = d.abort_requests(["d"])
        assert [o.finish_reason for o in outs] == ["abort"]
        _drive([d])
        _all_free(d)
    finally:
        p.close()
        d.close()


def _fake_prefill_side(done: dict):
    """A listener that answers one pull with no KV at all, then ``done``; its port."""
    import socket
    import threading

    from sloserve.kv_transfer.transport import expect, recv_msg, send_msg
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        expect(recv_msg(conn), "hello")
        expect(recv_msg(conn), "need")
        send_msg(conn, {"t": "done", **done})
        time.sleep(1)
        conn.close()
        srv.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


@pytest.mark.parametrize("done, why", [
    ({"output_token_ids": [10 ** 9], "num_computed_tokens": 37}, "the first tokens must be"),
    ({"output_token_ids": [], "num_computed_tokens": 37}, "the first tokens must be"),
    ({"output_token_ids": [28], "num_computed_tokens": 37}, "pieces of KV missing"),
], ids=["token-outside-vocab", "no-token", "no-kv"])
def test_a_hostile_prefill_side_fails_its_transfer_and_poisons_nothing(tiny_llama_dir,
                                                                        reference, done, why):
    """`done` with a token outside the vocabulary, or before every block of every layer came:
    the transfer fails (``fail``), the engine serves on, and the prompt's blocks are not taken
    into the prefix cache (a plain request for the prompt computes it: the same output)."""
    d = EngineCore(_config(tiny_llama_dir, "kv_consumer", kv_load_failure_policy="fail"))
    try:
        port = _fake_prefill_side(done)
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=KVTransferParams(
            do_remote_prefill=True, transfer_id="x", remote_host="127.0.0.1", remote_port=port)))
        outs = _drive([d])
        assert outs["d"][-1].finish_reason == "abort" and why in outs["d"][-1].error
        _all_free(d)
        d.add_request(EngineCoreRequest("plain", PROMPT, SP, 0.0))
        outs = _drive([d])
        assert _tokens(outs["plain"]) == reference and outs["plain"][0].num_cached_tokens == 0
    finally:
        d.close()


def test_requests_the_connector_cannot_serve_are_refused(tiny_llama_dir):
    p = EngineCore(_config(tiny_llama_dir, "kv_producer"))
    try:
        for kv, msg in ((KVTransferParams(), "exactly one of"),
                        (KVTransferParams(do_remote_prefill=True, transfer_id="x",
                                          remote_host="h", remote_port=1), "kv_producer"),
                        (KVTransferParams(do_remote_decode=True, do_remote_prefill=True),
                         "exactly one of")):
            with pytest.raises(ValueError, match=msg):
                p.add_request(EngineCoreRequest("r", PROMPT, SP, 0.0, kv_transfer_params=kv))
        assert not p.has_unfinished_requests()
    finally:
        p.close()


def test_kv_transfer_config_is_checked():
    ok = KVTransferConfig.parse({"kv_role": "kv_both", "kv_connector_extra_config": {
        "max_bandwidth": "0.4gbit", "mode": "push", "granularity": "eager"}})
    assert (ok.max_bandwidth, ok.mode, ok.granularity, ok.incremental) == \
        (5e7, "push", "eager", True)
    for bad, msg in (({}, "kv_role is required"),
                     ({"kv_role": "kv_both", "kv_port": 70000}, "kv_port must be"),
                     ({"kv_role": "kv_both", "x": 1}, "unknown key"),
                     ({"kv_role": "kv_both", "kv_connector_extra_config": {"transport": "rdma"}},
                      "transport must be one of tcp"),
                     ({"kv_role": "kv_both", "kv_connector_extra_config": {"timeout_s": 0}},
                      "timeout_s must be"),
                     ({"kv_role": "kv_both", "kv_connector_extra_config": {
                         "max_bandwidth": "fast"}}, "max_bandwidth"),
                     ({"kv_role": "kv_both", "kv_connector_extra_config": {
                         "max_bandwidth": "1e-30"}}, "max_bandwidth must be at least 1000"),
                     ({"kv_role": "kv_both", "kv_connector_extra_config": {"timeout_s": 1e300}},
                      "timeout_s must be"),
                     ({"kv_role": "kv_both", "kv_connector_extra_config": []},
                      "must be an object"),
                     ({"kv_role": "kv_both", "kv_ip": ""}, "kv_ip must be an address")):
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.parse(bad)
