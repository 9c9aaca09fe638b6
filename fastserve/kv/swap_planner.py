"""Swap planning (paper §4.2): which jobs' KV to bring in, push out or drop at one decision, over
counts the caller passes; candidates come in its order (ENST for MLFQ). Changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class BlockCounts(Protocol):
    def num_blocks(self, job_id: str) -> int: ...
    def movable_blocks(self, job_id: str) -> int: ...
    def swap_in_blocks(self, job_id: str) -> int: ...


@dataclass
class SwapDecision:
    swap_in: list[str] = field(default_factory=list)
    swap_out: list[str] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_in or self.swap_out or self.drop)


@dataclass(frozen=True)
class PoolCounts:
    """Free blocks after the batch's allocations."""

    free_device: int
    free_host: int
    device_releasing: int = 0


def plan_swaps(
    kv: BlockCounts,
    pools: PoolCounts,
    *,
    keep_free: int,
    wanted: Mapping[str, int],
    prefetch: Iterable[str],
    victims: Iterable[str],
    can_evict: Callable[[str], bool],
    drop: bool,
    drop_when_host_full: bool = False,
    max_skips: int = 16,
    prefetch_headroom: int = 0,
) -> SwapDecision:
    """Swap in ``wanted`` (host jobs the next batch would run, with their blocks), then prefetch,
    each while ``keep_free`` stays free (prefetch also ``prefetch_headroom``); a job that does not
    fit is passed over, at most ``max_skips`` times. Then evict until ``keep_free`` plus what wanted
    jobs still need is free by the next decision. ``drop_when_host_full``: the stall breaker's."""
    decision = SwapDecision()
    free = pools.free_device
    brought: set[str] = set()

    def bring(job_ids: Iterable[str], keep: int) -> None:
        nonlocal free
        skips = 0
        for job_id in job_ids:
            if job_id in brought:
                continue
            n = max(kv.swap_in_blocks(job_id), wanted.get(job_id, 0))
            if free - n < keep:
                skips += 1
                if skips > max_skips or free <= keep:
                    return
                continue
            decision.swap_in.append(job_id)
            brought.add(job_id)
            free -= n

    bring(wanted, keep_free)
    if all(j in brought for j in wanted):
        # Else what prefetch brings in is evicted again for the wanted job, plan after plan.
        bring(prefetch, keep_free + prefetch_headroom)
    target = keep_free + sum(n for j, n in wanted.items() if j not in brought)
    free_soon = free + pools.device_releasing
    host_free = pools.free_host
    for job_id in victims:
        if free_soon >= target:
            break
        if job_id in brought or not can_evict(job_id):
            continue
        n, on_host = kv.movable_blocks(job_id), kv.num_blocks(job_id)
        if drop or (on_host > host_free and drop_when_host_full):
            decision.drop.append(job_id)
        elif on_host <= host_free:
            decision.swap_out.append(job_id)
            host_free -= on_host
        else:
            continue
        free_soon += n
    return decision
