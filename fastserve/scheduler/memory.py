"""``MemoryPlanner``: the swap side of a decision (paper §4.2) and the stall breaker, a pure planner.
Eviction *for* a job the batch wants is the batch walk's (``batcher``)."""

from __future__ import annotations

from fastserve.kv.enst import EnstTable
from fastserve.kv.manager import Residency
from fastserve.kv.swap_planner import PoolCounts, SwapDecision, plan_swaps
from fastserve.scheduler.decision import BatchDecision
from fastserve.scheduler.queues import LevelScore
from fastserve.scheduler.state import KVView, SchedulerView


class _Counts:
    """Block counts after the batch: its admissions' shared prefix blocks stay when a holder leaves."""

    def __init__(self, kv: KVView, batch: BatchDecision) -> None:
        self.kv = kv
        self.keep = frozenset(batch.shared_hits)

    def movable_blocks(self, job_id: str) -> int:
        return self.kv.movable_blocks(job_id, self.keep)

    def swap_in_blocks(self, job_id: str) -> int:
        return self.kv.swap_in_blocks(job_id)

    def num_blocks(self, job_id: str) -> int:
        return self.kv.num_blocks(job_id)


class MemoryPlanner:
    def __init__(self, view: SchedulerView) -> None:
        self.view = view

    def plan(self, batch: BatchDecision, step: int, now: float,
             table: EnstTable | None) -> SwapDecision:
        """Proactive: prefetch and offload by ENST; otherwise only FCFS's evictions for growth."""
        view = self.view
        mode = view.kv_config.swap_mode
        policy = view.policy
        unmet = sum(batch.growth_needs.values())
        if policy.evicts_for_admission:
            unmet += sum(batch.waiting_needs.values())
        if mode != "proactive" and policy.preempts_for_priority:
            return SwapDecision()
        # Needs the walk could not meet are never met from equal or higher priority.
        keep = 0 if policy.preempts_for_priority else unmet
        if mode == "proactive":
            keep += batch.next_growth
            if policy.evicts_for_admission:
                keep += view.reserve_blocks(now)
        headroom = view.kv_config.prefetch_headroom_iterations * batch.next_growth
        if policy.preempts_for_priority:
            headroom += unmet
        taken = self._taken(batch)
        protected = batch.protected
        drop = mode == "recompute"

        def can_evict(job_id: str) -> bool:
            # A part-done prefill is not dropped: two long prompts could drop each other forever.
            return (job_id not in protected and job_id not in taken
                    and not view.pinned(job_id, step)
                    and not (drop and view.jobs[job_id].prefilling))

        prefetch = view.queues.ordered("onhost", self._score(table, 1.0)) if mode == "proactive" else ()
        return plan_swaps(_Counts(view.kv, batch), self._pools(batch), keep_free=keep,
                          wanted=batch.wanted_host, prefetch=prefetch,
                          victims=view.queues.ordered("evictable", self._score(table, -1.0)),
                          can_evict=can_evict, drop=drop,
                          max_skips=view.config.max_batch_size,
                          prefetch_headroom=headroom)

    def plan_unstick(self, batch: BatchDecision, swaps: SwapDecision,
                     table: EnstTable | None) -> SwapDecision:
        """Nothing runs or is in flight: evict any idle job (pins ignored) for the focus job, which
        then runs within two decisions — the no-deadlock guarantee."""
        view = self.view
        focus = batch.focus
        if batch.runs or view.num_inflight or focus is None:
            return SwapDecision()
        kv = _Counts(view.kv, batch)
        job = view.jobs[focus]
        pools = self._pools(batch)
        moved_in = sum(kv.swap_in_blocks(j) for j in swaps.swap_in)
        dropped = sum(kv.movable_blocks(j) for j in swaps.drop)
        moved_out = sum(kv.movable_blocks(j) for j in swaps.swap_out)
        host_taken = sum(kv.num_blocks(j) for j in swaps.swap_out)
        pools = PoolCounts(pools.free_device - moved_in + dropped, pools.free_host - host_taken,
                           pools.device_releasing + moved_out)
        taken = self._taken(batch) | set(swaps.swap_out) | set(swaps.drop) | set(swaps.swap_in) \
            | set(batch.claims)
        need = view.kv.device_blocks_needed(focus, job.num_tokens)
        decision = plan_swaps(kv, pools, keep_free=need, wanted={}, prefetch=(),
                              victims=view.queues.ordered("evictable", self._score(table, -1.0)),
                              can_evict=lambda j: j != focus and j not in taken,
                              drop=view.kv_config.swap_mode == "recompute",
                              # Both tiers full: admission waits, no admitted KV dies (§3.4).
                              drop_when_host_full=job.admitted)
        free_now = pools.free_device + sum(kv.movable_blocks(j) for j in decision.drop)
        if (view.kv.residency(focus) is Residency.HOST and focus not in swaps.swap_in
                and kv.swap_in_blocks(focus) <= free_now):
            decision.swap_in.append(focus)
        return decision

    def _pools(self, batch: BatchDecision) -> PoolCounts:
        """What the walk left plus what it set aside for wanted host jobs (the swap plan brings them)."""
        free = batch.free_device + sum(batch.wanted_host.values())
        return PoolCounts(free, batch.free_host, batch.unclaimed_release)

    @staticmethod
    def _taken(batch: BatchDecision) -> set[str]:
        return {a.job_id for a in batch.actions}

    def _score(self, table: EnstTable | None, sign: float) -> LevelScore | None:
        if table is None:
            return None
        jobs = self.view.jobs
        return lambda level, job_id: sign * table(level, jobs[job_id].starve_due)
