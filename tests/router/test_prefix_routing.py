"""Prefix-aware routing end to end: engine block pools publish KV events over ZeroMQ, the
router subscribes, and requests go to the replica whose events hold their prompt's blocks."""
from __future__ import annotations

import time

from sloserve.engine.block_hash import extend_block_hashes
from sloserve.engine.block_pool import BlockPool
from sloserve.engine.kv_events import KVEventPublisher

from .stubs import served_by, char_tokens, chat_text

BS = 16


def _cache(prompt_tokens: list[int], salt=None) -> list[tuple]:
    """The event records of an engine block pool caching a prompt's full blocks."""
    pool = BlockPool(64, BS)
    pool.enable_kv_events()
    hashes = extend_block_hashes([], prompt_tokens, BS, salt)
    blocks = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        pool.cache_block(b, h, parent_hash=hashes[i - 1] if i else None,
                         token_ids=prompt_tokens[i * BS:(i + 1) * BS])
    return pool.take_events()


def _cached_blocks(router) -> dict[str, int]:
    return {w["url"]: w.get("cached_blocks", 0)
            for w in router.client.get("/health").json()["workers"]}


def _publish_until(router, pub, records, url, blocks, timeout=10.0) -> None:
    """Publish until the router's index shows ``blocks`` for ``url`` (a SUB socket hears
    nothing sent before its subscription reached the publisher)."""
    deadline = time.monotonic() + timeout
    while _cached_blocks(router)[url] != blocks:
        assert time.monotonic() < deadline, _cached_blocks(router)
        pub.publish(records)
        time.sleep(0.05)


def test_requests_follow_the_replica_holding_their_prefix(stub, live_router, tmp_path):
    a, b = stub("a"), stub("b")
    eps = [f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]
    pubs = [KVEventPublisher({"enable_kv_cache_events": True, "endpoint": e}) for e in eps]
    try:
        r = live_router(replicas=[a.url, b.url], routing_policy="prefix-aware",
                        kv_events_endpoints=eps, speculative_ttl=0)
        prompt = "You are a helpful assistant. " * 4 + "Question one?"  # 129 tokens
        _publish_until(r, pubs[1], _cache(char_tokens(prompt)), b.url, 8)
        assert [served_by(r.client.post("/v1/completions", json={"prompt": prompt}))
                for _ in range(3)] == ["b", "b", "b"]
        # the same system prompt, another question: 7 of 8 blocks cached on b
        other = prompt[:-len("Question one?")] + "And another question, please?"
        assert served_by(r.client.post("/v1/completions", json={"prompt": other})) == "b"
        # nothing cached anywhere: least outstanding, then the fewest cached blocks: a
        assert served_by(r.client.post("/v1/completions", json={"prompt": "z" * 200})) == "a"
        # a chat, tokenized by a worker's /tokenize through its template
        messages = [{"role": "system", "content": "Be brief. " * 10},
                    {"role": "user", "content": "hello"}]
        _publish_until(r, pubs[0], _cache(char_tokens(chat_text(messages))), a.url,
                       len(chat_text(messages)) // BS)
        assert served_by(r.client.post("/v1/chat/completions", json={"messages": messages})) \
            == "a"
        # token-id prompts need no tokenizer
        assert served_by(r.client.post("/v1/completions",
                                       json={"prompt": char_tokens(prompt)})) == "b"
        text = r.client.get("/metrics").text
        assert 'sloserve_router_routing_decisions_total{decision="prefix_match",' \
               'policy="prefix-aware"}' in text
        # b's cache was reset: it is no longer preferred
        _publish_until(r, pubs[1], [("AllBlocksCleared",)], b.url, 0)
        assert served_by(r.client.post("/v1/completions", json={"prompt": prompt})) == "b"
        assert r.router.index.num_blocks(a.url) > 0  # (b: the fewest cached blocks)
    finally:
        for p in pubs:
            p.close()


def test_a_late_router_replays_what_it_missed_and_forgets_a_dead_replica(stub, live_router,
                                                                         tmp_path):
    a = stub("a")
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/a.sock",
           "replay_endpoint": f"ipc://{tmp_path}/a-replay.sock", "topic": "kv"}
    pub = KVEventPublisher(cfg)
    try:
        records = _cache(char_tokens("q" * 80))  # 5 blocks
        pub.publish(records[:2])  # before any router listens
        pub.publish(records[2:4])
        time.sleep(0.1)
        r = live_router(replicas=[a.url], kv_events_config=cfg)  # prefix-aware by default
        assert r.router.config.policy == "prefix-aware"
        # the next batch's sequence number shows 2 were missed: they are replayed
        _publish_until(r, pub, records[4:], a.url, 5)
        sub = r.router.subscribers[0]
        assert sub.num_lost == 0
        a.kill()
        r.wait_for(lambda: r.states()[a.url] == "down")
        assert _cached_blocks(r)[a.url] == 0  # a restarted engine starts empty
    finally:
        pub.close()
