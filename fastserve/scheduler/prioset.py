"""``PrioritySet``: job ids by numeric key with cheap add, discard, pop-min — a heap with lazy
deletion, compacted past twice its live size. It keeps a decision from scanning every queued job."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count

#: A number, not a tuple: heaps compare keys, and numbers compare several times faster.
Key = float

#: Below this many stale entries a compaction is not worth its O(n) rebuild.
_COMPACT_MIN_STALE = 64


class PrioritySet:
    def __init__(self) -> None:
        self._heap: list[tuple[Key, int, str]] = []
        self._live: dict[str, int] = {}
        self._tokens = count()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def add(self, job_id: str, key: Key) -> None:
        token = next(self._tokens)
        live = self._live
        live[job_id] = token
        heap = self._heap
        heapq.heappush(heap, (key, token, job_id))
        if len(heap) > 2 * len(live) + _COMPACT_MIN_STALE:
            self._heap = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def discard(self, job_id: str) -> None:
        self._live.pop(job_id, None)

    def peek(self) -> tuple[Key, str] | None:
        heap, live = self._heap, self._live
        while heap:
            key, token, job_id = heap[0]
            if live.get(job_id) == token:
                return key, job_id
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[Key, str] | None:
        heap, live = self._heap, self._live
        while heap:
            key, token, job_id = heapq.heappop(heap)
            if live.get(job_id) == token:
                del live[job_id]
                return key, job_id
        return None
