"""Swap planning: which jobs' KV to bring in, push out or drop at one decision (paper §4.2).

Pure decision logic over counts the caller passes (the device blocks free once this decision's
batch has its blocks, the host blocks free, the device blocks in-flight steps release) and the
``KVCacheManager``'s per-job block counts; it returns a ``SwapDecision`` and changes nothing (the
scheduler's ``apply`` runs it). Candidates come in the order the scheduler supplies (by ENST for
MLFQ: smallest first for swap-in, largest first for swap-out).

* Swap in the jobs the next batch wants (on the host, would have run) first, then — only when
  all of them came in — prefetch in ENST order, each while the device keeps ``keep_free``
  blocks free afterwards (prefetch also ``prefetch_headroom`` more, so what it brings is not
  pushed out again by the next growth). A job that does not fit is passed over, not the end of
  the walk (a smaller one behind it may fit); the walk gives up after ``max_skips`` such jobs
  so a decision never scans every queued job.
* Then swap out (or drop, in recompute mode) until the blocks free by the next decision — free
  now, plus those in-flight steps release — reach ``keep_free`` plus what wanted jobs still on
  the host need. Swapped-out blocks come back only when this plan completes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class BlockCounts(Protocol):
    """What the planner reads of the KV manager."""

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
    """Free blocks as the decision sees them (after its batch's allocations)."""

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
    """Decide swaps for one plan.

    ``keep_free``: device blocks to keep free for the next iteration (reserve + known needs).
    ``wanted``: jobs on the host the next batch would run, in batch order, and the device blocks
    each needs (its table and its next growth); they are brought in before any prefetch.
    ``drop``: evict by dropping KV (recompute) instead of swapping out.
    ``drop_when_host_full``: a victim that does not fit the host is dropped rather than
    skipped (only the stall breaker uses it: progress over keeping the KV).
    ``prefetch_headroom``: blocks prefetch leaves free beyond ``keep_free`` (wanted jobs do not).
    """
    decision = SwapDecision()
    free = pools.free_device
    brought: set[str] = set()

    def bring(job_ids: Iterable[str], keep: int) -> None:
        nonlocal free
        skips = 0
        for job_id in job_ids:
            if job_id in brought:
                continue
            # A wanted job runs next: set aside its table and the growth of that run.
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
        # Prefetch only into memory no wanted job is waiting for: else what it brings in is
        # evicted again for the wanted job, plan after plan.
        bring(prefetch, keep_free + prefetch_headroom)
    target = keep_free + sum(n for j, n in wanted.items() if j not in brought)
    free_soon = free + pools.device_releasing
    host_free = pools.free_host
    for job_id in victims:
        if free_soon >= target:
            break
        if job_id in brought or not can_evict(job_id):
            continue
        # The device frees the blocks no other job holds; the host takes at most the table.
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
