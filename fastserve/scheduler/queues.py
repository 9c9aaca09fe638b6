"""``LevelQueues``: per level, the candidate sets a decision walks (so it touches only jobs it can
use), the job counts ENST reads (running jobs included, §4.3), and the starvation clocks.
Which set a job belongs in is the ``Applier``'s call."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastserve.scheduler.prioset import Key, PrioritySet

SetName = Literal["ready", "pending", "evictable", "onhost"]
#: Score of a level's best candidate when merging levels (lower comes first).
LevelScore = Callable[[int, str], float]


class StarvationClocks:
    """Idle jobs watched for starvation, by ``Job.starve_due``."""

    def __init__(self) -> None:
        self._due = PrioritySet()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._due

    def add(self, job_id: str, due: float) -> None:
        self._due.add(job_id, due)   # a job's earlier entry goes stale

    def discard(self, job_id: str) -> None:
        self._due.discard(job_id)

    def first_overdue(self, now: float) -> str | None:
        top = self._due.peek()
        if top is not None and now > top[0]:
            return top[1]
        return None


@dataclass
class Level:
    """``ready``: resident, by order; ``pending``: no KV or on host, by order; ``evictable``: the
    ready ones by swap-out preference; ``onhost``: settled on host, by swap-in preference."""

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
        """Walk one kind of set across levels: ``score`` (lower first) merges the levels' tops, else
        levels go highest first. Entries are restored on exit; apply decisions after the walk."""
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
