"""Prefill/decode disaggregation's failures end to end, on real processes: `sloserve serve`
instances of the tiny Llama behind `sloserve router` (the concurrent flow; push mode,
layer-wise), each instance a process group killed with SIGKILL while a prompt's KV is on the
wire. Two decode instances, D_fail (``kv_load_failure_policy: fail``) and D_rec
(``recompute``), serve behind two routers, one over prefill instance P1, the other over P2 (a
second P costs less than restarting the killed one). Two requests at once: the routers' decode
choice (least outstanding) puts one on each D.

* P1 killed mid-transfer: the decode sides' loads fail; D_fail fails its request (its OpenAI
  error passed through the router), D_rec prefills the prompt itself and answers one engine's
  greedy text; neither keeps a block; the router's ``/health`` says 503, its prefill server down.
* both Ds killed mid-transfer: P2's router's clients get an error at once (a 502 in OpenAI's
  shape; in a stream under way an error event, ``[DONE]`` and the stream's end), P2 frees the
  requests' blocks (at its ``timeout_s`` at the latest), the router's ``/health`` says 503, the
  decode servers down.

The transfers are slowed by P's ``max_bandwidth``: the sender's token bucket lets its first
1 MiB go at once, so two prompts of 2600 tokens (1.3 MB of float32 KV each on this model: 512
bytes a token) leave most of their KV behind the bucket, for longer than P's ``timeout_s``.
Each kill comes as soon as the router has P's two answers (the prefill halves are over, the
transfers are not): well inside those seconds. The times from a kill to the clients' errors
and to the blocks' release are printed, never bounded (a generous timeout guards each wait).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

#: prompt tokens of each request (over the model's 512 positions: the env var below)
PROMPT_TOKENS = 2600
#: a prompt's KV on the wire: its 163 blocks of 16 tokens, 512 bytes a token (2 layers x K, V
#: x 2 KV heads x 16 dims x 4 bytes)
PROMPT_KV_BYTES = -(-PROMPT_TOKENS // 16) * 16 * 512
MAX_TOKENS = 4
#: P's sender: bytes/s past its token bucket's first 1 MiB
MAX_BANDWIDTH = 250_000
#: P holds a finished request's blocks (and lets its transfer run) this long
P_TIMEOUT_S = 3
#: D waits this long for a load: past the test, so that only the kills fail loads
D_TIMEOUT_S = 60
#: guard every wait and client against a hang; not bounds on speed
HANG_GUARD_S = 60.0
STARTUP_GUARD_S = 300.0

ENGINE_FLAGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "384",
                "--max-model-len", "4096", "--max-num-batched-tokens", "8192",
                "--served-model-name", "m", "--log-level", "warning"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(seed: int) -> list[int]:
    """Token ids that share no block with another test's (no prefix-cache hit anywhere)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


def _body(prompt: list[int], **kw) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **kw}


class Proc:
    """A command in a process group of its own, its output in ``log``."""

    def __init__(self, name: str, argv: list[str], port: int, log: str, env: dict):
        self.name, self.argv, self.port, self.log, self.env = name, argv, port, log, env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)

    def signal(self, sig) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 15) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout)

    def tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return ""


class Cluster:
    """P1, P2, D_fail, D_rec and two routers (P1 or P2 with both Ds)."""

    def __init__(self, model: str, tmp: str):
        exe = os.path.join(os.path.dirname(sys.executable), "sloserve")
        # positions past the tiny model's 512 are fine here; the engine cores' IPC folders go
        # to the test's tmp folder (a killed core leaves its folder behind)
        env = {**os.environ, "SLOSERVE_ALLOW_LONG_MAX_MODEL_LEN": "1", "TMPDIR": tmp}

        def proc(name: str, args: list[str]) -> Proc:
            port = _free_port()
            return Proc(name, [exe, *args, "--port", str(port)], port,
                        os.path.join(tmp, f"{name}.log"), env)

        def server(name: str, role: str, policy: str, timeout_s: float) -> Proc:
            kv = {"kv_role": role, "kv_port": 0, "kv_load_failure_policy": policy,
                  "kv_connector_extra_config": {"mode": "push", "granularity": "layerwise",
                                                "timeout_s": timeout_s,
                                                "max_bandwidth": MAX_BANDWIDTH}}
            return proc(name, ["serve", model, *ENGINE_FLAGS,
                               "--kv-transfer-config", json.dumps(kv)])

        self.p1 = server("P1", "kv_producer", "fail", P_TIMEOUT_S)
        self.p2 = server("P2", "kv_producer", "fail", P_TIMEOUT_S)
        self.d_fail = server("D_fail", "kv_consumer", "fail", D_TIMEOUT_S)
        self.d_rec = server("D_rec", "kv_consumer", "recompute", D_TIMEOUT_S)
        self.decodes = [self.d_fail, self.d_rec]

        def router(name: str, p: Proc) -> Proc:
            return proc(name, ["router", "--prefill", p.url, "--decode",
                               *(d.url for d in self.decodes), "--log-level", "warning"])

        self.router1, self.router2 = router("router1", self.p1), router("router2", self.p2)
        self.procs = [self.p1, self.p2, *self.decodes, self.router1, self.router2]

    def ensure_up(self, router: Proc | None = None) -> None:
        """(Re)start what ``router`` (None: both) needs that is not running, all at once, and
        wait until the router sees each of its servers healthy."""
        routers = [router] if router is not None else [self.router1, self.router2]
        need = [*self.decodes]
        for r in routers:
            need += [r, self.p1 if r is self.router1 else self.p2]
        for p in need:
            if not p.alive:
                p.signal(signal.SIGKILL)  # whatever is left of its group
                p.wait()
                p.start()

        def ready():
            for p in need:
                assert p.alive, f"{p.name} exited:\n{p.tail()}"
            for r in routers:
                h = httpx.get(r.url + "/health", timeout=5)
                if h.status_code != 200 or any(w["state"] != "healthy"
                                               for w in h.json()["workers"]):
                    return False
            return True

        wait_until(ready, "the router to see every server of its healthy", STARTUP_GUARD_S)

    def stop(self) -> None:
        for p in self.procs:  # a clean shutdown, all at once; SIGKILL for what lingers
            if p.alive:
                p.signal(signal.SIGTERM)
        for p in self.procs:
            p.wait()
            p.signal(signal.SIGKILL)


def wait_until(cond, what: str, guard: float = HANG_GUARD_S):
    """Poll ``cond`` until it is truthy (a refused connection counts as not yet); its value."""
    t0 = time.monotonic()
    last = None
    while True:
        try:
            v = cond()
            if v:
                return v
        except httpx.HTTPError as e:
            last = e
        assert time.monotonic() - t0 < guard, (f"hang guard: waited {guard:g} s for {what} "
                                               f"(last error: {last!r})")
        time.sleep(0.05)


def router_outstanding(router: Proc) -> dict[str, float]:
    """The router's requests in flight per worker URL."""
    text = httpx.get(router.url + "/metrics", timeout=5).text
    return {s.labels["worker"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "sloserve_router_outstanding_requests"}


def server_state(url: str) -> dict[str, float]:
    """A server's KV gauges and counters from its ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=5).text
    m = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            m[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return {"usage": m["vllm:kv_cache_usage_perc"],
            "held": m["sloserve:num_requests_waiting_for_kv"],
            "running": m["vllm:num_requests_running"],
            "waiting": m["vllm:num_requests_waiting"],
            "sent": m["sloserve:kv_transfer_bytes_total{direction=sent}"],
            "received": m["sloserve:kv_transfer_bytes_total{direction=received}"],
            "failures": m["sloserve:kv_transfer_failures_total"]}


def wait_no_blocks_held(server: Proc) -> dict[str, float]:
    """Poll until ``server`` holds no KV block and has no request; its last state."""
    last: dict = {}

    def free():
        last.update(server_state(server.url))
        return (last["usage"] == 0 and last["held"] == 0 and last["running"] == 0
                and last["waiting"] == 0)

    try:
        wait_until(free, f"{server.name} to free every KV block")
    except AssertionError as e:
        raise AssertionError(f"{e}; its last state {last}") from None
    return last


class Client(threading.Thread):
    """One request to a router, on a thread: ``status`` and ``json``, or for an SSE answer its
    ``events`` (each ``(arrival, data)``); ``ended_at`` when the answer was over."""

    def __init__(self, router: Proc, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = router.url, body
        self.status = self.json = self.error = self.ended_at = None
        self.events: list[tuple[float, str]] = []
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body,
                              timeout=HANG_GUARD_S) as r:
                self.status = r.status_code
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append((time.monotonic(), line[len("data: "):]))
                else:
                    self.json = json.loads(r.read())
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.error = e
        self.ended_at = time.monotonic()

    def result(self) -> "Client":
        self.join(HANG_GUARD_S + 10)
        assert not self.is_alive(), "hang guard: the router's client got no answer"
        assert self.error is None, f"the client failed: {self.error!r}"
        return self


def assert_openai_error(obj: dict, code: int) -> str:
    """``obj`` is OpenAI's error shape with ``code``; returns its message."""
    assert set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["code"] == code and isinstance(err["message"], str) and err["message"], err
    return err["message"]


def kill_mid_transfer(router: Proc, p: Proc, decodes: list[Proc], victims: list[Proc]) -> float:
    """Wait until ``p`` has answered the router both requests' prefill halves (it finished
    them and holds their blocks for the transfers) while each decode server still has its
    request, then SIGKILL the ``victims``' process groups; the moment after the kills."""

    def mid_transfer():
        out = router_outstanding(router)
        return out.get(p.url) == 0 and all(out.get(d.url) == 1 for d in decodes)

    wait_until(mid_transfer, f"{p.name} to answer both prefill halves, one request on each D")
    for v in victims:
        v.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for v in victims:
        v.wait()
    return killed_at


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    c = Cluster(tiny_llama_dir, str(tmp_path_factory.mktemp("pd-failures")))
    try:
        c.ensure_up()
        yield c
    finally:
        c.stop()


def _router_health(router) -> tuple[bool, dict[str, str]]:
    """Whether the router's /health says 503 "unavailable", and each worker's state."""
    h = httpx.get(router.url + "/health", timeout=5)
    body = h.json()
    return (h.status_code == 503 and body["status"] == "unavailable",
            {w["url"]: w["state"] for w in body["workers"]})


def test_prefill_killed_mid_transfer_fails_or_recomputes_and_frees_the_decode_blocks(cluster):
    router, p, decodes = cluster.router1, cluster.p1, cluster.decodes
    cluster.ensure_up(router)
    prompt = _prompt(1)
    # one engine's greedy text: D_rec's alone; then its prefix cache is forgotten, so that the
    # P/D request's whole prompt has to cross the wire
    r = httpx.post(cluster.d_rec.url + "/v1/completions", json=_body(prompt),
                   timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["text"]
    assert httpx.post(cluster.d_rec.url + "/reset_prefix_cache", timeout=10).status_code == 200
    before = {d.name: server_state(d.url) for d in decodes}

    clients = [Client(router, _body(prompt)) for _ in range(2)]
    killed_at = kill_mid_transfer(router, p, decodes, [p])
    for c in clients:
        c.result()
    by_status = {c.status: c for c in clients}
    assert sorted(by_status) == [200, 500], [(c.status, c.json) for c in clients]
    ok, failed = by_status[200], by_status[500]
    assert ok.json["choices"][0]["text"] == want  # D_rec prefilled it: one engine's tokens
    assert ok.json["usage"]["completion_tokens"] == MAX_TOKENS
    msg = assert_openai_error(failed.json, 500)  # D_fail's error, as it gave it
    assert msg.startswith("KV transfer failed:"), msg
    print(f"\nP1 killed: D_fail's client got its 500 after {failed.ended_at - killed_at:.3f} s "
          f"({msg!r}), D_rec's its recomputed answer after {ok.ended_at - killed_at:.3f} s")

    for d in decodes:  # no block left on either decode side; its load failed, cut short
        s = wait_no_blocks_held(d)
        got = s["received"] - before[d.name]["received"]
        assert s["failures"] == before[d.name]["failures"] + 1, (d.name, s)
        assert got < PROMPT_KV_BYTES, (d.name, s)
        print(f"{d.name} held no block {time.monotonic() - killed_at:.3f} s after the kill "
              f"(it had received {got:.0f} of the prompt's {PROMPT_KV_BYTES} bytes of KV)")

    def prefill_down():
        unavailable, states = _router_health(router)
        return unavailable and states[p.url] == "down"

    wait_until(prefill_down, "the router's /health to say its prefill server is down")


def test_decode_killed_mid_transfer_errors_the_clients_and_frees_the_prefill_blocks(cluster):
    router, p, decodes = cluster.router2, cluster.p2, cluster.decodes
    cluster.ensure_up(router)
    prompt = _prompt(2)
    streamed = Client(router, _body(prompt, stream=True))
    whole = Client(router, _body(prompt))
    killed_at = kill_mid_transfer(router, p, decodes, decodes)

    whole.result()
    assert whole.status == 502, (whole.status, whole.json)
    msg = assert_openai_error(whole.json, 502)
    streamed.result()
    assert streamed.status == 200  # the decode server had begun its stream
    datas = [d for _, d in streamed.events]
    # no token (the KV never arrived), an error event, [DONE], the end of the stream
    assert len(datas) == 2 and datas[1] == "[DONE]", datas
    stream_msg = assert_openai_error(json.loads(datas[0]), 502)
    print(f"\nD_fail and D_rec killed: the non-streamed client got its 502 after "
          f"{whole.ended_at - killed_at:.3f} s ({msg!r}); the streamed one its error event "
          f"after {streamed.events[0][0] - killed_at:.3f} s and the stream's end after "
          f"{streamed.ended_at - killed_at:.3f} s ({stream_msg!r})")

    s = wait_no_blocks_held(p)  # its sends fail, or its timeout_s passes
    assert s["failures"] >= 1 and s["sent"] < 2 * PROMPT_KV_BYTES, s
    print(f"P2 held no block {time.monotonic() - killed_at:.3f} s after the kill "
          f"(timeout_s {P_TIMEOUT_S}); {s['failures']:.0f} transfers failed there, "
          f"{s['sent']:.0f} of their {2 * PROMPT_KV_BYTES} bytes of KV sent")

    def decode_down():
        unavailable, states = _router_health(router)
        return (unavailable and all(states[d.url] == "down" for d in decodes)
                and states[p.url] == "healthy")

    wait_until(decode_down, "the router's /health to say both decode servers are down")
