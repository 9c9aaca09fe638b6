"""``LevelQueues``: per level, the candidate sets a decision walks (so it touches only jobs it can
use), the job counts ENST reads (running jobs included, §4.3), and the starvation clocks.
Which set a job belongs in is the ``Applier``'s call."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from fastserve.scheduler.prioset import PrioritySet

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

    def ordered(self, name: SetName, score: LevelScore | None = None,
                lowest_first: bool = False) -> Iterator[str]:
        """One kind of set across levels, removing nothing: ``score`` (lower first) merges the levels'
        tops, else levels go highest first (lowest first if asked), each walked only once reached.
        The sets must not change while it is walked."""
        if score is None:
            levels = reversed(self.levels) if lowest_first else iter(self.levels)
            for lv in levels:
                for _key, job_id in getattr(lv, name).ordered():
                    yield job_id
            return
        walks = [getattr(lv, name).ordered() for lv in self.levels]
        heap: list[tuple[float, int, str]] = []
        for i, walk in enumerate(walks):
            if (top := next(walk, None)) is not None:
                heap.append((score(i + 1, top[1]), i, top[1]))
        heapq.heapify(heap)
        while heap:
            _, i, job_id = heapq.heappop(heap)
            if (nxt := next(walks[i], None)) is not None:
                heapq.heappush(heap, (score(i + 1, nxt[1]), i, nxt[1]))
            yield job_id
