"""Disconnect storm: 200 streamed requests (completions and chat, mixed) cancelled at seeded
random points: right after sending (the client reads nothing), right after the response
headers (most are then still queued in the core), during their prefill chunks and mid-decode.
Afterwards no KV block is held by any request (blocks kept only by the prefix cache
count as free), nothing runs or waits, and greedy output is what it was before. And a client
that leaves during a long prefill stops it partway, not after its whole prompt, and once the
core applied the abort nothing more of that request is computed (from the core's step trace).
No check bounds how soon an abort lands: the front end runs in the pytest process and a loaded
host can deschedule it while the core process keeps stepping.

The step trace (``--step-trace``) names the request of every prefill chunk and every admission
(``prefill_ids``, ``admitted_ids``); each storm request has a prompt length no other has, so the
test knows which trace entries are whose.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass

import httpx
import pytest

from sloserve.config import EngineConfig
from sloserve.sampling_params import SamplingParams

N_REQUESTS = 200
BUDGET = 32  # --max-num-batched-tokens of the storm server: a 256-480 token prompt is 8-15 chunks
MAX_LEN = 512  # the tiny checkpoint's context
WORDS = ("apple river stone cloud maple tiger copper violet harbor lantern meadow falcon orbit "
         "pepper canyon velvet willow ember glacier quartz sparrow thunder cobalt nectar island "
         "marble saddle prism walnut breeze").split()


class Trace:
    """Tails the core's step trace: which request (by id) was admitted with how many prompt
    tokens, and every prefill chunk of each request as (step start, tokens, start position)."""

    def __init__(self, path: str):
        self.path = path
        self._pos = 0
        self._buf = ""
        self.rows: list[dict] = []
        self.length_of: dict[str, int] = {}      # request id -> prompt tokens
        self.id_of_length: dict[int, str] = {}   # prompt tokens -> request id (unique here)
        self.chunks: dict[str, list[tuple[float, int, int]]] = {}

    def poll(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._pos)
                data = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return
        self._buf += data
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if not line:
                continue
            r = json.loads(line)
            self.rows.append(r)
            for (_, n), rid in zip(r["admitted"], r["admitted_ids"]):
                self.length_of[rid] = n
                self.id_of_length[n] = rid
            for (n, start), rid in zip(r["prefill_chunks"], r["prefill_ids"]):
                self.chunks.setdefault(rid, []).append((r["t"], n, start))

    def skip_to_end(self) -> None:
        """Forget what the trace holds so far (only later steps count)."""
        self.poll()
        self.rows.clear()
        self.length_of.clear()
        self.id_of_length.clear()
        self.chunks.clear()

    def prefill_done(self, rid: str) -> bool:
        """Some chunk of the request reached the end of its prompt."""
        n = self.length_of[rid]
        return any(start + k == n for _, k, start in self.chunks.get(rid, ()))


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n_words))


@dataclass
class Planned:
    kind: str        # "pre" | "queued" | "prefill" | "decode"
    path: str        # /v1/completions or /v1/chat/completions
    body: dict
    length: int      # prompt tokens, unique among the storm's requests
    arg: int = 0     # prefill: close after this many chunks; decode: after this many content events
    delay: float = 0.0  # seconds after the storm starts
    # outcome
    events: int = 0
    finished: bool = False
    status: int = 0
    fallback: bool = False


def _prompt_len(engine, path: str, body: dict) -> int:
    if "chat" in path:
        ids = engine.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        return len(engine.make_request(ids, SamplingParams(max_tokens=1)).prompt_token_ids)
    return len(engine.make_request(body["prompt"], SamplingParams(max_tokens=1)).prompt_token_ids)


def plan_storm(engine, seed: int = 20261201) -> list[Planned]:
    """200 requests, each kind about half completions half chat, every prompt length
    distinct, arriving at seeded random times."""
    rng = random.Random(seed)
    kinds = ["pre"] * 25 + ["queued"] * 25 + ["prefill"] * 70 + ["decode"] * 80
    rng.shuffle(kinds)
    used: set[int] = set()
    out, t = [], 0.0
    for i, kind in enumerate(kinds):
        lo, hi = {"pre": (40, 250), "queued": (40, 250), "prefill": (256, 480),
                  "decode": (8, 200)}[kind]
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        while True:
            text = _text(rng, rng.randrange(max(1, lo // 3), hi // 3 + 1))
            body = {"temperature": 0, "ignore_eos": True, "stream": True}
            if "chat" in path:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            n = _prompt_len(engine, path, body)
            if lo <= n <= hi and n not in used:
                break
        used.add(n)
        # as many tokens as fit: left alone, every request would run for hundreds of steps, so
        # only the aborts can empty the engine within the storm's one second
        body["max_tokens"] = MAX_LEN - n
        arg = 0
        if kind == "prefill":
            arg = rng.randint(1, max(1, n // BUDGET // 2))  # at most half-way through
        elif kind == "decode":
            arg = rng.randint(1, 8)  # far below max_tokens: always mid-decode
        t += rng.expovariate(1 / 0.008)  # ~125 arrivals/s: a long queue behind 16 seats
        out.append(Planned(kind, path, body, n, arg, t))
    return out


def _content_events(line: str) -> tuple[int, bool]:
    """(1 if the SSE data line carries generated text else 0, whether it finishes the choice)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return 0, False
    d = json.loads(line[6:])
    ch = (d.get("choices") or [{}])[0]
    text = ch.get("text") or (ch.get("delta") or {}).get("content")
    return (1 if text else 0), ch.get("finish_reason") is not None


async def _raw_send_and_close(port: int, p: Planned) -> None:
    """Write the whole HTTP request and close at once, reading nothing."""
    body = json.dumps(p.body).encode()
    head = (f"POST {p.path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def _one(client: httpx.AsyncClient, port: int, trace: Trace, p: Planned,
               t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + p.delay - time.monotonic()))
    if p.kind == "pre":
        await _raw_send_and_close(port, p)
        return
    async with client.stream("POST", p.path, json=p.body) as r:
        p.status = r.status_code
        if p.kind == "queued" or r.status_code != 200:
            return  # leaving the block closes the connection
        if p.kind == "prefill":
            reader = asyncio.ensure_future(_count_events(r, p))
            deadline = time.monotonic() + 30
            while not reader.done():
                rid = trace.id_of_length.get(p.length)
                if rid is not None and len(trace.chunks.get(rid, ())) >= p.arg:
                    break
                if time.monotonic() > deadline:
                    p.fallback = True
                    break
                await asyncio.sleep(0.002)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            return
        async for line in r.aiter_lines():  # decode: close after `arg` content events
            n, fin = _content_events(line)
            p.events += n
            p.finished |= fin
            if p.events >= p.arg or fin:
                return


async def _count_events(r: httpx.Response, p: Planned) -> None:
    async for line in r.aiter_lines():
        n, fin = _content_events(line)
        p.events += n
        p.finished |= fin


async def _tail(trace: Trace, stop: asyncio.Event) -> None:
    while not stop.is_set():
        trace.poll()
        await asyncio.sleep(0.002)


async def run_storm(port: int, trace: Trace, plan: list[Planned]) -> float:
    """Run every planned request; returns time.monotonic() when the last client was gone."""
    stop = asyncio.Event()
    tailer = asyncio.ensure_future(_tail(trace, stop))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                 limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(_one(client, port, trace, p, t0) for p in plan))
    done = time.monotonic()
    stop.set()
    await tailer
    return done


def _greedy(http: httpx.Client) -> tuple[str, str]:
    a = http.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 16,
                                           "temperature": 0, "ignore_eos": True})
    b = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16,
        "temperature": 0, "ignore_eos": True})
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    return a.json()["choices"][0]["text"], b.json()["choices"][0]["message"]["content"]


def _gauge(metrics_text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", metrics_text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.fixture(scope="module")
def storm_server(helpers, tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama (float32, one torch thread: steps of a few ms) with a small token
    budget and 16 seats (prefill chunks take the budget first, so a long queue waits), writing
    a step trace."""
    trace = str(tmp_path_factory.mktemp("storm") / "trace.jsonl")
    srv = helpers.start_server(EngineConfig(model=tiny_llama_dir, dtype="float32",
                                            num_kv_blocks=128, max_model_len=MAX_LEN,
                                            max_num_batched_tokens=BUDGET, max_num_seqs=16,
                                            num_threads=1), step_trace=trace)
    yield srv, trace
    srv.stop()


def test_disconnect_storm_leaks_no_block_and_changes_no_output(storm_server, helpers):
    srv, trace_path = storm_server
    engine = srv.engine
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        before = _greedy(http)
        helpers.wait_all_blocks_free(engine, timeout=60)
        received0 = engine.stats.num_requests_received_total
        plan = plan_storm(engine)
        trace = Trace(trace_path)
        trace.skip_to_end()  # the greedy requests' steps are not the storm's
        last_client_gone = asyncio.run(run_storm(srv.port, trace, plan))

        # once the last client left: no block referenced, nothing running or waiting (free
        # counts the blocks only the prefix cache keeps), nothing left in the front end
        helpers.wait_all_blocks_free(engine, timeout=60)
        m = http.get("/metrics").text
        assert _gauge(m, "vllm:num_requests_running") == 0
        assert _gauge(m, "vllm:num_requests_waiting") == 0
        assert _gauge(m, "vllm:kv_cache_usage_perc") == 0
        stats = engine.stats
        trace.poll()

        # every kind of cancellation happened, as planned
        by_kind = {k: [p for p in plan if p.kind == k] for k in ("pre", "queued", "prefill",
                                                                 "decode")}
        assert all(p.status == 200 for p in plan if p.kind != "pre")
        assert not [p for p in plan if p.fallback]
        decode = by_kind["decode"]
        assert [p.events for p in decode] == [p.arg for p in decode]  # cut after k events
        assert not any(p.finished for p in decode + by_kind["queued"])
        admitted = {trace.id_of_length.get(p.length) for p in plan} - {None}
        received = stats.num_requests_received_total - received0
        # requests the core queued and never scheduled were aborted while waiting (many of the
        # 50 that left right after sending or after the headers; how many the core admits before
        # their client's abort arrives depends on the CPU's speed: 24 of 50 on a Zen 5 host under
        # the full suite's load), so the bound asks only that the waiting-abort path ran often
        assert received - len(admitted) >= 10, (received, len(admitted))
        cut_in_prefill = [p for p in by_kind["prefill"]
                          if p.length in trace.id_of_length
                          and not trace.prefill_done(trace.id_of_length[p.length])]
        # how many aborts land before the rest of the prompt (half of it at least, a few ms a
        # chunk) ran depends on how far the front end lags the core (65-70 of 70 here, quiet or
        # beside 4 busy loops on 2 cores); the leak checks above need only that this path ran,
        # and an abort held back until the prefill ends would leave none. How soon an abort
        # stops a prefill: the long-prefill test below, with a wide margin
        assert len(cut_in_prefill) >= 1, len(cut_in_prefill)
        # each prefill client left only once its request had run `arg` chunks (it waited)
        assert all(len(trace.chunks[trace.id_of_length[p.length]]) >= p.arg
                   for p in by_kind["prefill"] if p.length in trace.id_of_length
                   and not p.finished)
        storm_ids = {trace.id_of_length[p.length] for p in plan if p.length in trace.id_of_length}
        chunks_when_free = {rid: list(trace.chunks.get(rid, ())) for rid in storm_ids}
        rows_when_free = len(trace.rows)
        steps = trace.rows
        adm = {k: sum(p.length in trace.id_of_length for p in v) for k, v in by_kind.items()}
        print(f"\nstorm: {len(plan)} requests, {received} reached the core, {len(admitted)} "
              f"admitted (by kind {adm}), {received - len(admitted)} aborted while queued, "
              f"{len(cut_in_prefill)}/{len(by_kind['prefill'])} cut mid-prefill, "
              f"{len(decode)} cut mid-decode; {len(steps)} steps, "
              f"{stats.num_preemptions_total} preemptions; "
              f"{time.monotonic() - last_client_gone:.3f} s to the checks")

        # the blocks the storm's chats left in the prefix cache counted as free above and are
        # still cached: a new chat starts from the shared system-prompt block
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "A question nobody asked before."}],
            "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        # and greedy output is the same text as before the storm
        assert _greedy(http) == before
        helpers.wait_all_blocks_free(engine, timeout=60)
        # nothing of a storm request was computed once the storm drained: the steps of the
        # requests above are in the trace (written before their answers), none of theirs
        trace.poll()
        assert len(trace.rows) > rows_when_free
        assert {rid: trace.chunks.get(rid, []) for rid in storm_ids} == chunks_when_free
        # nor does the front end keep anything per request: of the requests it counts as on
        # their way to the core (for overload control, off here) only the last can be left
        assert len(engine._in_transit) <= 1, len(engine._in_transit)


# ------------------------------------------------------------ a long prefill, cut
LONG_PROMPT_BUDGET = 64
#: 2,000 token ids: 32 chunks of <= 64, each a dense step of ~0.2 s here (~0.5 s beside 4 busy
#: loops on 2 cores); the client leaves after 3, so the abort has ~29 steps (~6 s, longer as the
#: core is slowed) to land before the prompt's end, where it lands within the next step or two
#: here: a front end even 100x slower than the core still cuts it
LONG_PROMPT = 2000
SEEN_BEFORE_CLOSE = 3


#: SmolLM2-135M's shape (30 layers, hidden 576) with random weights: steps cost what the
#: embedded model's dense float32 steps cost, without reading and repacking the GGUF at start
SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                 "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                 "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
                 "eos_token_id": 2, "hidden_act": "silu"}


@pytest.fixture(scope="module")
def prefill_server(helpers, tmp_path_factory):
    """A model of SmolLM2-135M's size (random weights, float32, one torch thread) with a
    64-token budget: a 2,000-token prompt is 32 chunks, each a dense step of a tenth of a second
    or more, far longer than an abort takes to reach the core."""
    folder = tmp_path_factory.mktemp("smollm2-shape")
    (folder / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    trace = str(tmp_path_factory.mktemp("prefill") / "trace.jsonl")
    srv = helpers.start_server(EngineConfig(model=str(folder), load_format="dummy",
                                            dtype="float32", num_kv_blocks=256,
                                            max_model_len=2048,
                                            max_num_batched_tokens=LONG_PROMPT_BUDGET,
                                            num_threads=1),
                               step_trace=trace)
    yield srv, trace
    srv.stop()


def test_disconnect_during_a_long_prefill_stops_it_at_the_next_chunk(prefill_server, helpers):
    """The client leaves once 3 chunks ran: the prefill stops partway (at the chunk boundary
    after the abort reaches the core; how soon that is depends on the host, so no bound on it)
    and, once the core applied the abort, no chunk of the request runs any more."""
    srv, trace_path = prefill_server
    engine = srv.engine
    prompt = list(range(1000, 1000 + LONG_PROMPT))
    n_chunks = -(-len(prompt) // LONG_PROMPT_BUDGET)  # 32
    trace = Trace(trace_path)

    async def go() -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200
                deadline = time.monotonic() + 60  # a hang guard
                while True:
                    trace.poll()
                    rid = trace.id_of_length.get(len(prompt))
                    if rid is not None and len(trace.chunks[rid]) >= SEEN_BEFORE_CLOSE:
                        break
                    assert time.monotonic() < deadline, "the prefill did not get going"
                    await asyncio.sleep(0.005)
                seen = len(trace.chunks[rid])
                t_close = time.monotonic()
            return t_close, seen  # closed on leaving

    t_close, seen = asyncio.run(go())
    # the abort reached the core and it dropped the request: nothing runs, every block is free
    # (the chunk in flight finishes first, however long a step takes on a loaded machine)
    helpers.wait_all_blocks_free(engine, timeout=60.0)
    trace.poll()  # every step up to the abort (rows are written before the stats it published)
    rid = trace.id_of_length[len(prompt)]
    chunks = list(trace.chunks[rid])
    rows_when_free = len(trace.rows)
    total = sum(n for _, n, _ in chunks)
    # the prefill went on in order, chunk after chunk, from the start of the prompt ...
    assert [start for _, _, start in chunks] == [i * LONG_PROMPT_BUDGET
                                                 for i in range(len(chunks))], chunks
    assert seen >= SEEN_BEFORE_CLOSE and len(chunks) >= seen
    # ... and was cut: it never reached the end of the prompt, a whole chunk's budget of it at
    # least was never computed, and it never sampled a token
    assert not trace.prefill_done(rid)
    assert total <= len(prompt) - LONG_PROMPT_BUDGET, (total, len(prompt))
    assert not any(r["decode_contexts"] for r in trace.rows)
    # once the core applied the abort nothing of the request is computed: a further request
    # runs (its steps are in the trace, written before its answer), and no chunk of it follows
    r = httpx.post(srv.base_url + "/v1/completions", json={
        "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0, "ignore_eos": True},
        timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    helpers.wait_all_blocks_free(engine, timeout=60.0)
    trace.poll()
    assert len(trace.rows) > rows_when_free
    assert trace.chunks[rid] == chunks, (trace.chunks[rid], chunks)
    after = [n for t, n, _ in chunks if t >= t_close]  # steps started after the client left
    print(f"\nlong prefill: {len(chunks)} of {n_chunks} chunks computed ({total} of "
          f"{len(prompt)} tokens), {seen} seen before the disconnect, {len(after)} started "
          f"after it; steps of {[round(r['step_s'], 3) for r in trace.rows[:rows_when_free]]} s")
