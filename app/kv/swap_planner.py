"""Swap planning: which jobs' KV to bring in, push out or drop at one decision (paper §4.2).

Pure decision logic over the ``KVCacheManager``'s counts: it walks candidates in the order the
scheduler supplies (by ENST for MLFQ: smallest first for swap-in, largest first for swap-out)
and returns a ``SwapDecision``; the scheduler applies it (the KV manager emits the commands).

* Swap in, in order, while the device keeps ``keep_free`` blocks free afterwards (proactive
  prefetch: the job is resident before it is scheduled).
* Then swap out (or drop, in recompute mode) until the blocks free by the next decision — free
  now, plus those in-flight steps release — reach ``keep_free`` plus what the next batch wants
  for jobs still on the host. Swapped-out blocks come back only when this plan completes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from app.kv.manager import KVCacheManager


@dataclass
class SwapDecision:
    swap_in: list[str] = field(default_factory=list)
    swap_out: list[str] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_in or self.swap_out or self.drop)


def plan_swaps(
    kv: KVCacheManager,
    *,
    keep_free: int,
    wanted: Mapping[str, int],
    prefetch: Iterable[str],
    victims: Iterable[str],
    can_evict: Callable[[str], bool],
    drop: bool,
    drop_when_host_full: bool = False,
) -> SwapDecision:
    """Decide swaps for one plan.

    ``keep_free``: device blocks to keep free for the next iteration (reserve + known needs).
    ``wanted``: jobs on the host the next batch would run, and the device blocks each needs.
    ``drop``: evict by dropping KV (recompute) instead of swapping out.
    ``drop_when_host_full``: a victim that does not fit the host is dropped rather than
    skipped (only the stall breaker uses it: progress over keeping the KV).
    """
    decision = SwapDecision()
    free = kv.num_free_device
    for job_id in prefetch:
        n = kv.num_blocks(job_id)
        if free - n < keep_free:
            break
        decision.swap_in.append(job_id)
        free -= n
    brought = set(decision.swap_in)
    target = keep_free + sum(n for j, n in wanted.items() if j not in brought)
    free_soon = free + kv.device_releasing
    host_free = kv.num_free_host
    for job_id in victims:
        if free_soon >= target:
            break
        if not can_evict(job_id):
            continue
        n = kv.num_blocks(job_id)
        if drop or (n > host_free and drop_when_host_full):
            decision.drop.append(job_id)
        elif n <= host_free:
            decision.swap_out.append(job_id)
            host_free -= n
        else:
            continue
        free_soon += n
    return decision
