"""The KV connector's shared-memory transport (``transport: shm``) between two in-process
engine cores: the same greedy output and byte counts as TCP, the KV through a segment (headers
on the connection), no segment left in /dev/shm after a transfer however it ends, a decode side
on another host served over TCP (one warning), and hostile ``shm`` / ``kv`` headers refused."""
from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time

import pytest

from sloserve.config import KVTransferConfig
from sloserve.engine.core import EngineCore
from sloserve.engine.messages import EngineCoreRequest, KVTransferParams
from sloserve.kv_transfer import shm
from sloserve.kv_transfer.transport import expect, recv_msg, send_msg
from sloserve.sampling_params import SamplingParams

from .test_kv_connector import (PREFIX, PROMPT, SP, _all_free, _block_bytes, _config, _drive,
                                _params, _tokens)
from .test_kv_connector import reference  # noqa: F401 - the fixture: one engine's greedy output

pytestmark = pytest.mark.skipif(shm.host_identity() is None, reason="no /dev/shm here")

BLOCKS = -(-len(PROMPT) // 4)


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(shm.PREFIX)}


@pytest.fixture(autouse=True)
def no_segment_left():
    before = _segments()
    yield
    assert _segments() - before == set(), "a shared-memory segment outlived its transfer"


@pytest.fixture
def created(monkeypatch) -> list[tuple[str, int]]:
    """(name, bytes) of each segment made during the test."""
    made, real = [], shm.Segment.create.__func__

    def create(cls, nbytes):
        seg = real(cls, nbytes)
        made.append((seg.name, nbytes))
        return seg
    monkeypatch.setattr(shm.Segment, "create", classmethod(create))
    return made


def _pair(model, mode, policy="recompute", **extra):
    p = EngineCore(_config(model, "kv_producer", mode=mode, transport="shm"))
    return p, EngineCore(_config(model, "kv_consumer", policy, mode=mode, transport="shm",
                                 **extra))


def _until(cond, core=None) -> None:
    t = time.monotonic()
    while not cond():
        if core is not None and core.has_unfinished_requests():
            core.step()
        time.sleep(0.001)
        assert time.monotonic() - t < 30


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_shm_output_equals_colocated_and_counts_the_bytes_tcp_does(tiny_llama_dir, reference,
                                                                   created, mode):
    """Layer-wise, incremental (D has 5 of the 10 blocks): the KV of the 5 others goes through
    one segment of exactly their size; the counters say what TCP's say (test_kv_connector)."""
    p, d = _pair(tiny_llama_dir, mode)
    try:
        d.add_request(EngineCoreRequest("warm", PREFIX, SamplingParams(max_tokens=1), 0.0))
        _drive([d])
        payloads = []
        d.runner.kv_connector.on_receive = lambda buf: payloads.append(type(buf))
        pk, dk = _params(p, d, mode)
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        outs = _drive([p, d])
        assert _tokens(outs["d"]) == reference and _tokens(outs["p"]) == reference[:1]
        assert outs["d"][0].num_cached_tokens == 20
        sent = p.stats().kv_transfer_bytes_sent_total
        assert sent == (BLOCKS - 5) * _block_bytes(p) == d.stats().kv_transfer_bytes_received_total
        assert [n for _, n in created] == [sent]
        assert payloads and set(payloads) == {memoryview}  # read from the segment, not a socket
        _all_free(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_shm_decode_side_mapping_after_the_last_frame_still_gets_the_segment(
        tiny_llama_dir, reference, created, monkeypatch, mode):
    """A busy D reads ``shm`` only after P wrote every frame: P's ``done`` (which unlinks the
    name) waits for D's ``mapped``, so D still maps the segment and nothing fails."""
    p, d = _pair(tiny_llama_dir, mode)
    real = shm.Segment.attach.__func__
    whole = BLOCKS * _block_bytes(p)

    def late_attach(cls, name, nbytes):
        t = time.monotonic()
        while p.runner.kv_connector.bytes_sent < whole and time.monotonic() - t < 30:
            time.sleep(0.001)
        time.sleep(0.05)  # and then some: P's `done` is queued by now
        return real(cls, name, nbytes)
    monkeypatch.setattr(shm.Segment, "attach", classmethod(late_attach))
    try:
        pk, dk = _params(p, d, mode)
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        outs = _drive([p, d])
        assert _tokens(outs["d"]) == reference
        assert d.stats().kv_transfer_failures_total == 0
        assert d.stats().kv_transfer_bytes_received_total == whole == [n for _, n in created][0]
        _all_free(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("end", ["prefill-side-gone", "decode-side-aborted"])
def test_shm_transfer_ended_midway_frees_everything(tiny_llama_dir, reference, created, end):
    """Some KV has gone through the segment when P dies (D prefills the prompt itself) or D's
    request is aborted (P's send ends): every block is freed, no segment is left."""
    p, d = _pair(tiny_llama_dir, "pull")
    p_open = True
    try:
        pk, dk = _params(p, d, "pull")
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        d.add_request(EngineCoreRequest("d", PROMPT, SP, 0.0, kv_transfer_params=dk))
        p.step()  # P's first chunk: its two full blocks go, layer by layer; P stops there
        _until(lambda: d.stats().kv_transfer_bytes_received_total > 0, d)
        assert len(created) == 1 and created[0][0] not in _segments()  # D mapped it, unlinked
        if end == "prefill-side-gone":
            p.close()
            p_open = False
            outs = _drive([d])
            assert _tokens(outs["d"]) == reference
            assert d.stats().kv_transfer_failures_total == 1
            _all_free(d)
        else:
            assert [o.finish_reason for o in d.abort_requests(["d"])] == ["abort"]
            _drive([p, d])
            _all_free(p, d)
    finally:
        if p_open:
            p.close()
        d.close()


def _fake_decode_side(got: dict) -> int:
    """A listener that takes one push, asks for every block from this host, notes the segment
    P names (``got["shm"]``, ``got["event"]`` set), never maps it and reads until P hangs up.
    Its port."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        conn.settimeout(30)
        try:
            expect(recv_msg(conn), "hello")
            send_msg(conn, {"t": "need", "first_block": 0, "host": shm.host_identity()})
            got["shm"] = expect(recv_msg(conn), "shm")
            got["event"].set()
            while conn.recv(1 << 16):
                pass
        except OSError:
            pass
        finally:
            conn.close()
            srv.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_shm_push_cancelled_before_the_decode_side_mapped_the_segment(tiny_llama_dir):
    """P's segment exists until D maps it; P's request aborted before that: P unlinks it."""
    p = EngineCore(_config(tiny_llama_dir, "kv_producer", mode="push", transport="shm"))
    try:
        got = {"event": threading.Event()}
        pk = KVTransferParams(do_remote_decode=True, transfer_id="t1", remote_host="127.0.0.1",
                              remote_port=_fake_decode_side(got))
        p.add_request(EngineCoreRequest("p", PROMPT, SP, 0.0, kv_transfer_params=pk))
        p.step()  # registers the push (it connects) and computes the first chunk
        assert got["event"].wait(30)
        name = got["shm"]["name"]
        assert got["shm"]["nbytes"] == BLOCKS * _block_bytes(p) and name in _segments()
        p.abort_requests(["p"])
        _drive([p])
        assert name not in _segments()
        _all_free(p)
    finally:
        p.close()


def test_shm_decode_side_on_another_host_is_served_over_tcp(tiny_llama_dir, reference, created,
                                                            caplog):
    """D's identity differs (another host): both transfers go over TCP, with the bytes TCP
    sends (every block: not incremental), and P warns once."""
    p, d = _pair(tiny_llama_dir, "pull", incremental=False)
    try:
        d.runner.kv_connector.host_identity = "another-boot-id/0"
        caplog.set_level(logging.WARNING, logger="sloserve.kv_transfer.worker_side")
        for tid in ("t1", "t2"):
            pk, dk = _params(p, d, "pull", tid=tid)
            p.add_request(EngineCoreRequest("p" + tid, PROMPT, SP, 0.0, kv_transfer_params=pk))
            d.add_request(EngineCoreRequest("d" + tid, PROMPT, SP, 0.0, kv_transfer_params=dk))
        outs = _drive([p, d])
        assert _tokens(outs["dt1"]) == _tokens(outs["dt2"]) == reference
        sent = p.stats().kv_transfer_bytes_sent_total
        assert sent == d.stats().kv_transfer_bytes_received_total == 2 * BLOCKS * _block_bytes(p)
        assert created == []
        warnings = [r.getMessage() for r in caplog.records if "sending over TCP" in r.getMessage()]
        assert len(warnings) == 1 and "is on another host" in warnings[0]
        _all_free(p, d)
    finally:
        p.close()
        d.close()


def _fake_prefill_side(msgs: list[dict], whole: int) -> tuple[int, threading.Thread]:
    """A listener that answers one pull: reads ``hello`` and ``need`` (which must offer shared
    memory), makes a segment of ``whole`` bytes, sends ``msgs`` (``"SEG"``: its name), waits
    for the decode side to hang up and removes the segment. Its port, and its thread."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        conn.settimeout(30)
        seg = shm.Segment.create(whole)
        try:
            expect(recv_msg(conn), "hello")
            assert expect(recv_msg(conn), "need")["host"] == shm.host_identity()
            for m in msgs:
                send_msg(conn, {k: seg.name if v == "SEG" else v for k, v in m.items()})
            while conn.recv(1 << 16):  # `mapped`, if it maps the segment, then the hang-up
                pass
        except OSError:
            pass
        finally:
            conn.close()
            srv.close()
            seg.close()
            seg.unlink()
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return srv.getsockname()[1], th


def test_shm_hostile_headers_fail_the_transfer(tiny_llama_dir):
    """A ``shm`` message naming something else or the wrong size, a ``kv`` frame at an offset
    without a segment, outside it or not on a block's boundary: the transfer fails (``fail``),
    nothing is left behind."""
    d = EngineCore(_config(tiny_llama_dir, "kv_consumer", "fail", transport="shm"))
    lbb = d.runner.kv_connector.layer_block_bytes
    whole = BLOCKS * _block_bytes(d)
    kv = {"t": "kv", "layer": 0, "b0": 0, "b1": 1, "nbytes": lbb}
    seg = {"t": "shm", "name": "SEG", "nbytes": whole}
    cases = [
        ([{**seg, "name": "psm_other"}], "expected a sloserve-kv-*"),
        ([{**seg, "name": "/dev/shm/SEG"}], "expected a sloserve-kv-*"),
        ([{**seg, "nbytes": whole - lbb}], "expected a sloserve-kv-*"),
        ([{**kv, "off": 0}], "no segment named"),
        ([seg, {**kv, "off": whole - lbb + 4}], "does not fit the segment"),
        ([seg, {**kv, "off": lbb + 4}], "does not fit the segment"),
        ([seg, seg], "a second shm message"),
    ]
    try:
        for i, (msgs, why) in enumerate(cases):
            port, th = _fake_prefill_side(msgs, whole)
            d.add_request(EngineCoreRequest(f"d{i}", PROMPT, SP, 0.0, kv_transfer_params=(
                KVTransferParams(do_remote_prefill=True, transfer_id=f"x{i}",
                                 remote_host="127.0.0.1", remote_port=port))))
            outs = _drive([d])
            th.join(30)
            assert outs[f"d{i}"][-1].finish_reason == "abort", why
            assert why in outs[f"d{i}"][-1].error, (why, outs[f"d{i}"][-1].error)
            _all_free(d)
    finally:
        d.close()


def test_segments_reserve_their_memory_and_unlink_once(monkeypatch):
    seg = shm.Segment.create(4096)
    try:
        seg.buf[:4] = b"kv!!"
        peer = shm.Segment.attach(seg.name, 4096)
        assert bytes(peer.buf[:4]) == b"kv!!" and shm.valid_name(seg.name)
        peer.unlink()
        assert seg.name not in _segments()
        peer.unlink()
        seg.unlink()  # gone already: nothing to say
        peer.close()
        with pytest.raises(FileNotFoundError):
            shm.Segment.attach(seg.name, 4096)
    finally:
        seg.close()

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        shm.Segment.create(1 << 20)  # /dev/shm too small: no segment (the autouse check)
    assert not shm.valid_name("../sloserve-kv-x") and not shm.valid_name("sloserve-kv-a/b")


def test_transport_shm_is_a_choice():
    assert KVTransferConfig.parse({"kv_role": "kv_both", "kv_connector_extra_config": {
        "transport": "shm"}}).transport == "shm"
    with pytest.raises(ValueError, match="transport must be one of tcp, shm, got 'rdma'"):
        KVTransferConfig.parse({"kv_role": "kv_both",
                                "kv_connector_extra_config": {"transport": "rdma"}})
