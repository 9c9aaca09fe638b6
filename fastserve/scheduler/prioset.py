"""``PrioritySet``: job ids by numeric key with cheap add, discard, peek-min and an in-order walk — a
heap with lazy deletion, compacted past twice its live size. It keeps a decision from scanning every
queued job; equal keys come out in the order they were added."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count

#: A number, not a tuple: heaps compare keys, and numbers compare several times faster.
Key = float
#: (key, insertion token, job id): the token orders equal keys and tells a live entry from a stale one.
Entry = tuple[Key, int, str]

#: Below this many stale entries a compaction is not worth its O(n) rebuild.
_COMPACT_MIN_STALE = 64


class PrioritySet:
    def __init__(self) -> None:
        self._heap: list[Entry] = []
        #: job id -> its entry in the heap; any other entry of that job is stale.
        self._live: dict[str, Entry] = {}
        #: job id -> its discarded entry, still in the heap: re-added with the same key, it revives.
        self._dead: dict[str, Entry] = {}
        self._tokens = count()
        #: Stale entries walks have passed since the last compaction (they stay in the heap).
        self._stale_seen = 0

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def add(self, job_id: str, key: Key) -> None:
        live = self._live
        dead = self._dead.pop(job_id, None)
        if dead is not None and dead[0] == key and job_id not in live:
            live[job_id] = dead     # a job back with its old key keeps its place: no push, no stale entry
            return
        entry = (key, next(self._tokens), job_id)
        live[job_id] = entry
        heap = self._heap
        heapq.heappush(heap, entry)
        # Either bound keeps the rebuild's O(n) at O(1) a stale entry made or walked past.
        if len(heap) > 2 * len(live) + _COMPACT_MIN_STALE or self._stale_seen > len(live):
            self._heap = list(live.values())
            heapq.heapify(self._heap)
            self._dead.clear()
            self._stale_seen = 0

    def discard(self, job_id: str) -> None:
        entry = self._live.pop(job_id, None)
        if entry is not None:
            self._dead[job_id] = entry

    def _drop_stale_root(self) -> None:
        entry = heapq.heappop(self._heap)
        if self._dead.get(entry[2]) is entry:
            del self._dead[entry[2]]

    def peek(self) -> tuple[Key, str] | None:
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) is entry:
                return entry[0], entry[2]
            self._drop_stale_root()
        return None

    def ordered(self) -> Iterator[tuple[Key, str]]:
        """Live entries by key, without removing any: each step pops a frontier of heap positions
        whose parents were yielded, so k entries cost O(k log k) however large the set. The set must
        not change while the walk is open (a change to it ends the walk with an error)."""
        if self.peek() is None:     # stale entries at the root go for good before the walk starts
            return
        heap, live = self._heap, self._live
        size = len(heap)
        frontier: list[tuple[Entry, int]] = [(heap[0], 0)]
        while frontier:
            entry, i = heapq.heappop(frontier)
            if len(heap) != size or heap is not self._heap:
                raise RuntimeError("a PrioritySet changed while walked")
            if live.get(entry[2]) is entry:
                yield entry[0], entry[2]
            else:
                self._stale_seen += 1
            child = 2 * i + 1
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
                if child + 1 < size:
                    heapq.heappush(frontier, (heap[child + 1], child + 1))
