"""``LevelQueues``: the priority levels and the per-level candidate sets of the scheduler.

Owns, for every level, the jobs that a decision may pick, split by what they need so that a
decision touches only the few jobs it can use:

* ``ready``     — runnable and resident on the device (batch candidates), by order key;
* ``pending``   — no KV (admission) or KV on the host, by order key;
* ``evictable`` — same members as ``ready``, by swap-out preference (largest ENST first);
* ``onhost``    — KV settled on the host, by swap-in preference (smallest ENST first);

plus per-level job counts (running and in-transit jobs included: they stay in their queue, paper
§4.3) for ENST, and the starvation clocks (``StarvationClocks``). Which set a job belongs in is
decided by the scheduler; this module only keeps the sets.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from app.scheduler.prioset import Key, PrioritySet

SetName = Literal["ready", "pending", "evictable", "onhost"]
#: Score of a level's best candidate when merging levels (lower comes first).
LevelScore = Callable[[int, str], float]


class StarvationClocks:
    """Idle jobs watched for starvation, by last-served time, one set per number of promotions
    a job already had: its wait before promotion depends on that number (α times a backoff), so
    each set's oldest job is the first of that set to starve, whatever α is now."""

    def __init__(self) -> None:
        self._sets: dict[int, PrioritySet] = {}
        self._count: dict[str, int] = {}

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._count

    def add(self, job_id: str, last_served: float, promotions: int) -> None:
        self.discard(job_id)
        self._sets.setdefault(promotions, PrioritySet()).add(job_id, last_served)
        self._count[job_id] = promotions

    def discard(self, job_id: str) -> None:
        count = self._count.pop(job_id, None)
        if count is not None:
            self._sets[count].discard(job_id)

    def first_overdue(self, now: float, wait: Callable[[int], float]) -> str | None:
        """A job not served for longer than ``wait(its promotions)``, or None."""
        for count, watched in self._sets.items():
            top = watched.peek()
            if top is not None and now - top[0] > wait(count):
                return top[1]
        return None


@dataclass
class Level:
    ready: PrioritySet = field(default_factory=PrioritySet)
    pending: PrioritySet = field(default_factory=PrioritySet)
    evictable: PrioritySet = field(default_factory=PrioritySet)
    onhost: PrioritySet = field(default_factory=PrioritySet)

    def discard(self, job_id: str) -> None:
        self.ready.discard(job_id)
        self.pending.discard(job_id)
        self.evictable.discard(job_id)
        self.onhost.discard(job_id)


class LevelQueues:
    def __init__(self, num_levels: int) -> None:
        if num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {num_levels}")
        self.levels = [Level() for _ in range(num_levels)]
        self.counts = [0] * num_levels
        self.starving = StarvationClocks()

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def level(self, level: int) -> Level:
        return self.levels[level - 1]

    def join(self, level: int) -> None:
        self.counts[level - 1] += 1

    def leave(self, level: int) -> None:
        self.counts[level - 1] -= 1

    def discard(self, level: int, job_id: str) -> None:
        self.levels[level - 1].discard(job_id)
        self.starving.discard(job_id)

    @contextmanager
    def ordered(self, name: SetName, score: LevelScore | None) -> Iterator[Iterator[str]]:
        """Walk one kind of set across all levels in preference order, without changing it.

        Within a level the set's own key decides; across levels ``score(level, top_job)``
        (lower first) merges the levels' best candidates, or, without a score, levels go from
        highest priority down. Entries are popped while walking and all restored on exit, so a
        caller decides during the walk and applies its decisions after it.
        """
        popped: list[tuple[PrioritySet, Key, str]] = []

        def walk() -> Iterator[str]:
            sets = [getattr(lv, name) for lv in self.levels]
            if score is None:
                for s in sets:
                    while (top := s.pop()) is not None:
                        popped.append((s, top[0], top[1]))
                        yield top[1]
                return
            heap: list[tuple[float, int]] = []
            for i, s in enumerate(sets):
                if (top := s.peek()) is not None:
                    heap.append((score(i + 1, top[1]), i))
            heapq.heapify(heap)
            while heap:
                _, i = heapq.heappop(heap)
                top = sets[i].pop()
                if top is None:
                    continue
                popped.append((sets[i], top[0], top[1]))
                if (nxt := sets[i].peek()) is not None:
                    heapq.heappush(heap, (score(i + 1, nxt[1]), i))
                yield top[1]

        try:
            yield walk()
        finally:
            for s, key, job_id in popped:
                s.add(job_id, key)
