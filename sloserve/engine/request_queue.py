"""The scheduler's waiting queue, one class per ``--scheduling-policy`` (as vLLM v1's
``request_queue.py``): :class:`FCFSRequestQueue` and :class:`PriorityRequestQueue`, made by
:func:`create_request_queue`.

The queue is the policy: it keeps the waiting requests in the order they are admitted, and it
says which running request a preemption takes and whether a waiting request may preempt a
running one, so the scheduler never asks which policy it runs.

* ``fcfs``: arrival order; a preempted request goes back to the front. Preemption takes the
  most recently admitted running request; a waiting request never preempts.
* ``priority``: by (priority, arrival time), lower first, equal keys in the order they came;
  a preempted request goes back to its place in that order. Preemption takes the running
  request with the largest (priority, arrival time), the most recently admitted among equals;
  a waiting request preempts a running one of a strictly larger priority value.

Both keep the order they were given between insertions: SLO-aware deferral
(:meth:`RequestQueue.move_to_back`) and requests passed over in a step
(:meth:`RequestQueue.prepend_requests`) are kept where they are put, and a later insertion
finds its place among them as it finds it in a sorted queue (after the last request whose key
is not larger).

Plain Python: no torch, no clock.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from sloserve.config import QUEUE_POLICIES
from sloserve.engine.request import Request


class RequestQueue(ABC):
    """The waiting requests in admission order (iteration starts at the front)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request in its place by the policy."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Queue a preempted request again: at the front (FCFS) or in its place (priority)."""

    @abstractmethod
    def preemption_victim(self, running: list[Request]) -> Request:
        """The running request (``running``, non-empty, in admission order) a preemption
        takes."""

    @abstractmethod
    def outranks(self, request: Request, running: Request) -> bool:
        """Waiting ``request`` may preempt ``running`` to be admitted."""

    def peek_request(self) -> Request:
        """The request at the front. Raises IndexError when empty."""
        return self._queue[0]

    def pop_request(self) -> Request:
        """Take the request at the front. Raises IndexError when empty."""
        return self._queue.popleft()

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put back at the front, in their order, requests taken from the front this step (so
        the queue's order is what it was)."""
        self._queue.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        """Take ``request`` out. Raises ValueError when it is not queued."""
        self._queue.remove(request)

    def move_to_back(self, requests: Iterable[Request]) -> None:
        """Move the queued ``requests`` behind all others, each group keeping its order."""
        late = {id(r) for r in requests}
        if not late:
            return
        keep = [r for r in self._queue if id(r) not in late]
        self._queue = deque(keep + [r for r in self._queue if id(r) in late])

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[r.request_id for r in self._queue]})"


class FCFSRequestQueue(RequestQueue):
    """``fcfs``: arrival order (see the module docstring)."""

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def preemption_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def outranks(self, request: Request, running: Request) -> bool:
        return False


def _key(r: Request) -> tuple[int, float]:
    return r.priority, r.arrival_time


class PriorityRequestQueue(RequestQueue):
    """``priority``: by (priority, arrival time), lower first (see the module docstring)."""

    def add_request(self, request: Request) -> None:
        key, q = _key(request), self._queue
        i = len(q)
        while i > 0 and _key(q[i - 1]) > key:
            i -= 1
        q.insert(i, request)

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def preemption_victim(self, running: list[Request]) -> Request:
        return max(reversed(running), key=_key)

    def outranks(self, request: Request, running: Request) -> bool:
        return running.priority > request.priority


#: one queue class per ``--scheduling-policy`` (config.QUEUE_POLICIES)
QUEUES: dict[str, type[RequestQueue]] = {"fcfs": FCFSRequestQueue,
                                         "priority": PriorityRequestQueue}


def create_request_queue(policy: str) -> RequestQueue:
    """An empty queue of ``policy`` ("fcfs" or "priority", ``--scheduling-policy``).

    Raises:
        ValueError: another policy.
    """
    try:
        return QUEUES[policy]()
    except KeyError:
        raise ValueError(f"queue_policy must be {' or '.join(QUEUE_POLICIES)}, got "
                         f"{policy!r}") from None
