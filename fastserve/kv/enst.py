"""ENST, the Estimated Next Scheduled Time of a job (paper §4.2):

    ENST(i) = min(T_promote(i),  (1/B) · Σ_{j above i} Σ_{k = level(j)}^{level(i)−1} q_k)

T_promote is the time left before starvation promotes i (α − starve_time). The quanta are service
seconds; ``wall_per_service`` (step time ÷ q1) makes wall time. The sum depends on i only through
its level: computed per level once per decision, then ENST is O(1) per job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def level_waits(counts: Sequence[int], quanta: Sequence[float], batch_size: int) -> list[float]:
    """``waits[L-1]`` = (1/B)·Σ_{l<L} count(l)·(P(L−1) − P(l−1)), P(m) = q_1 + … + q_m: one pass."""
    if len(counts) != len(quanta):
        raise ValueError(f"{len(counts)} level counts but {len(quanta)} quanta")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    waits: list[float] = []
    prefix_q = 0.0          # P(L-1)
    jobs_above = 0          # C(L-1)
    weighted = 0.0          # Σ_{l<L} count(l)·P(l-1)
    for count, q in zip(counts, quanta, strict=True):
        waits.append((prefix_q * jobs_above - weighted) / batch_size)
        weighted += count * prefix_q
        jobs_above += count
        prefix_q += q
    return waits


def enst(until_promotion: float, level_wait: float) -> float:
    return min(until_promotion, level_wait)


class EnstTable:

    def __init__(self, counts: Sequence[int], quanta: Sequence[float], batch_size: int,
                 now: float, wall_per_service: float = 1.0) -> None:
        if wall_per_service <= 0:
            raise ValueError(f"wall_per_service must be > 0, got {wall_per_service}")
        self.waits = [w * wall_per_service for w in level_waits(counts, quanta, batch_size)]
        self.now = now

    def __call__(self, level: int, promote_at: float | None) -> float:
        """``promote_at`` None: never promoted."""
        until = math.inf if promote_at is None else promote_at - self.now
        return enst(until, self.waits[level - 1])
