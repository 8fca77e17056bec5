"""The waiting queue: which request is admitted next.

Order: preempted requests first (they already waited), then lower priority value, then
round-robin across clients (so one client flooding the queue cannot starve another), then arrival.
Knows nothing of blocks or budgets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from vllmlite.core.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._resumed: deque[Request] = deque()             # preempted, oldest-admitted first
        self._by_client: dict[str | None, deque[Request]] = {}
        self._turn = 0                                        # increases on every admission
        self._last_turn: dict[str | None, int] = {}       # when each client was last admitted

    def __len__(self) -> int:
        return len(self._resumed) + sum(len(q) for q in self._by_client.values())

    def __iter__(self) -> Iterator[Request]:
        yield from self._resumed
        for queue in self._by_client.values():
            yield from queue

    def add(self, request: Request) -> None:
        self._by_client.setdefault(request.client_id, deque()).append(request)

    def push_front(self, request: Request) -> None:
        """Requeue a preempted request ahead of everything that has not run yet."""
        self._resumed.appendleft(request)

    def peek(self) -> Request | None:
        if self._resumed:
            return self._resumed[0]
        best: Request | None = None
        best_key = None
        for client, queue in self._by_client.items():
            # Within a client, the lowest priority value then the earliest arrival.
            head = min(queue, key=lambda r: (r.priority, r.arrival_time))
            last = self._last_turn.get(client)
            # Never admitted (or not since everyone now waiting was) goes first; then least recent.
            key = (head.priority, last is not None, last or 0, head.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def pop(self, request: Request | None = None) -> Request:
        """Admit the head (or `request`, which a scheduler let pass the head)."""
        request = request or self.peek()
        if request is None or not self.remove(request):
            raise IndexError("pop from an empty WaitingQueue")
        self._last_turn[request.client_id] = self._turn
        self._turn += 1
        self._forget_stale_turns()
        return request

    def _forget_stale_turns(self) -> None:
        """Bound the turn memory. A client that is not waiting and whose last turn is older than the
        turn of every waiting client ranks ahead of all of them when it returns, with or without its
        turn remembered, so the entry can go. (Waiting clients never admitted keep everything.)"""
        turns = [self._last_turn.get(client) for client in self._by_client]
        if None in turns:
            return
        oldest_waiting = min(turns, default=self._turn)
        stale = [c for c, t in self._last_turn.items() if c not in self._by_client and t < oldest_waiting]
        for client in stale:
            del self._last_turn[client]

    def remove(self, request: Request) -> bool:
        if request in self._resumed:
            self._resumed.remove(request)
            return True
        queue = self._by_client.get(request.client_id)
        if queue is None or request not in queue:
            return False
        queue.remove(request)
        if not queue:
            del self._by_client[request.client_id]
        return True
