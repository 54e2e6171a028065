"""The waiting queue of each ``--scheduling-policy`` (sloserve.engine.request_queue)."""
from __future__ import annotations

import pytest

from sloserve.config import QUEUE_POLICIES
from sloserve.engine.request import Request
from sloserve.engine.request_queue import (QUEUES, FCFSRequestQueue, PriorityRequestQueue,
                                           create_request_queue)
from sloserve.sampling_params import SamplingParams


def _req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=arrival,
                   priority=priority)


def _ids(q) -> list[str]:
    return [r.request_id for r in q]


def test_one_queue_per_policy_and_others_refused():
    assert tuple(QUEUES) == QUEUE_POLICIES
    assert type(create_request_queue("fcfs")) is FCFSRequestQueue
    assert type(create_request_queue("priority")) is PriorityRequestQueue
    with pytest.raises(ValueError, match="queue_policy must be fcfs or priority, got 'lifo'"):
        create_request_queue("lifo")


def test_fcfs_is_arrival_order_and_a_preempted_request_goes_first():
    q = create_request_queue("fcfs")
    assert not q and len(q) == 0
    for rid, p in (("a", 9), ("b", 0), ("c", 5)):
        q.add_request(_req(rid, p))
    assert _ids(q) == ["a", "b", "c"] and len(q) == 3 and q
    q.prepend_request(_req("pre", 9))
    assert _ids(q) == ["pre", "a", "b", "c"]
    assert q.peek_request().request_id == "pre" and len(q) == 4
    assert q.pop_request().request_id == "pre" and _ids(q) == ["a", "b", "c"]


def test_priority_orders_by_priority_then_arrival_equal_keys_in_order_of_coming():
    q = create_request_queue("priority")
    for rid, p, t in (("a", 5, 0.0), ("b", 1, 1.0), ("c", 1, 0.5), ("d", 3, 0.1),
                      ("c2", 1, 0.5)):
        q.add_request(_req(rid, p, t))
    assert _ids(q) == ["c", "c2", "b", "d", "a"]
    q.prepend_request(_req("pre", 3, 0.05))  # preempted: back in its place, not the front
    assert _ids(q) == ["c", "c2", "b", "pre", "d", "a"]


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_requests_passed_over_go_back_to_the_front_in_their_order(policy):
    q = create_request_queue(policy)
    for rid in "abcd":
        q.add_request(_req(rid))
    held = [q.pop_request(), q.pop_request()]
    q.pop_request()  # c admitted
    q.prepend_requests(held)
    assert _ids(q) == ["a", "b", "d"]
    q.prepend_requests([])
    assert _ids(q) == ["a", "b", "d"]


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_remove_and_move_to_back(policy):
    q = create_request_queue(policy)
    reqs = {rid: _req(rid, arrival=i) for i, rid in enumerate("abcde")}
    for r in reqs.values():
        q.add_request(r)
    q.remove_request(reqs["c"])
    with pytest.raises(ValueError):
        q.remove_request(reqs["c"])
    q.move_to_back([reqs["d"], reqs["a"]])  # deferred: behind the others, in queue order
    assert _ids(q) == ["b", "e", "a", "d"]
    q.move_to_back([])
    assert _ids(q) == ["b", "e", "a", "d"]


def test_priority_insertion_after_a_deferral_goes_after_the_last_key_not_larger():
    """Deferral breaks the sorted order; a new request then goes after the last queued request
    whose key is not larger than its own, scanning from the back, as in a sorted queue."""
    q = create_request_queue("priority")
    a, b, c = _req("a", 1, 0.0), _req("b", 2, 1.0), _req("c", 3, 2.0)
    for r in (a, b, c):
        q.add_request(r)
    q.move_to_back([a])
    assert _ids(q) == ["b", "c", "a"]
    q.add_request(_req("x", 2, 5.0))
    assert _ids(q) == ["b", "c", "a", "x"]
    q.add_request(_req("y", 0, 5.0))
    assert _ids(q) == ["y", "b", "c", "a", "x"]


def test_preemption_victim_and_who_may_preempt():
    running = [_req("old", 1, 0.0), _req("low", 7, 1.0), _req("new", 3, 2.0),
               _req("low2", 7, 1.0)]
    fcfs, prio = create_request_queue("fcfs"), create_request_queue("priority")
    assert fcfs.preemption_victim(running).request_id == "low2"          # the newest admitted
    assert prio.preemption_victim(running).request_id == "low2"          # largest key, newest
    assert prio.preemption_victim(running[:3]).request_id == "low"
    assert prio.preemption_victim([running[0]]).request_id == "old"
    urgent, same = _req("u", 0, 9.0), _req("s", 7, 0.0)
    assert prio.outranks(urgent, running[1]) and not prio.outranks(same, running[1])
    assert not fcfs.outranks(urgent, running[1])                        # FCFS never preempts
