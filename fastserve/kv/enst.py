"""ENST, the Estimated Next Scheduled Time of a job (paper §4.2, DESIGN.md "KV cache").

    ENST(i) = min(T_promote(i),  (1/B) · Σ_{j above i} Σ_{k = level(j)}^{level(i)−1} q_k)

T_promote(i) is the time left before starvation promotes job i: its α (fixed when its wait
began, ``Job.starve_due``) less what it has waited — the paper's α − starve_time.

The quanta are service (``fastserve.scheduler.accounting``: a decode is charged one decode iteration,
q1), so the sum is the work ahead in service-seconds; B jobs advance together in one iteration,
hence the one division by B, and ``wall_per_service`` (measured step time ÷ q1) turns it into
wall time. The second term depends on job i only through its level, so it is computed once per
decision for every level from per-level job counts (O(levels)); ENST of any job is then O(1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def level_waits(counts: Sequence[int], quanta: Sequence[float], batch_size: int) -> list[float]:
    """``waits[L-1]`` = (1/B)·Σ over jobs j in levels l < L of Σ_{k=l}^{L-1} q_k.

    With P(m) = q_1 + … + q_m and C(m) = jobs in levels 1..m, a job at level l < L contributes
    P(L−1) − P(l−1), so the sum is P(L−1)·C(L−1) − Σ_{l<L} count(l)·P(l−1): one pass.
    """
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
    """ENST of one job from the time left before starvation promotes it and its level's wait
    (see ``level_waits``)."""
    return min(until_promotion, level_wait)


class EnstTable:
    """ENST of every job at one decision instant ``now``, O(1) per job."""

    def __init__(self, counts: Sequence[int], quanta: Sequence[float], batch_size: int,
                 now: float, wall_per_service: float = 1.0) -> None:
        if wall_per_service <= 0:
            raise ValueError(f"wall_per_service must be > 0, got {wall_per_service}")
        self.waits = [w * wall_per_service for w in level_waits(counts, quanta, batch_size)]
        self.now = now

    def __call__(self, level: int, promote_at: float | None) -> float:
        """ENST of a job in ``level`` that starvation promotes at ``promote_at`` (None: never,
        e.g. a job already in level 1)."""
        until = math.inf if promote_at is None else promote_at - self.now
        return enst(until, self.waits[level - 1])
