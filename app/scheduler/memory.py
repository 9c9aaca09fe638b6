"""``MemoryPlanner``: the swap side of a decision (paper §4.2, "Proactive KV cache management").

Turns what a batch could not get (and, in proactive mode, the reserve of burst slots) into swap
decisions via ``app.kv.swap_planner`` — ENST-ordered across levels for MLFQ policies, policy
order otherwise — and applies them: the KV manager emits the commands, this class moves the
jobs between candidate sets. Includes the stall breaker that guarantees progress.
"""

from __future__ import annotations

import math

from app.kv.enst import EnstTable
from app.kv.manager import Residency
from app.kv.swap_planner import SwapDecision, plan_swaps
from app.scheduler.batcher import BatchResult
from app.scheduler.job import Job, JobState
from app.scheduler.queues import LevelScore
from app.scheduler.state import SchedulerState


class MemoryPlanner(SchedulerState):
    def _plan_memory(self, batch: BatchResult, now: float, step: int) -> None:
        """Swaps for this plan: proactive prefetch/offload by ENST around the reserve, or
        on-demand eviction (reactive, recompute) for what this batch could not get."""
        mode = self.kv_config.swap_mode
        needs = sum(batch.growth_needs.values())
        for job_id in batch.wanted_host:
            if self._jobs[job_id].blocked_since is None:
                self._jobs[job_id].blocked_since = now
        if self.policy.evicts_for_admission:
            needs += sum(batch.waiting_needs.values())
        keep = needs
        if mode == "proactive":
            keep += batch.next_growth
            if self.policy.evicts_for_admission:
                keep += self.reserve_blocks(now)
        table = self._enst_table(now)
        protected = batch.protected
        jobs = self._jobs

        def can_evict(job_id: str) -> bool:
            # A job swapped in for its turn stays until it ran (no swap thrash).
            return job_id not in protected and not jobs[job_id].pinned

        with self.queues.ordered("evictable", self._score(table, -1.0)) as victims, \
                self.queues.ordered("onhost", self._score(table, 1.0)) as prefetch:
            decision = plan_swaps(self.kv, keep_free=keep, wanted=batch.wanted_host,
                                  prefetch=prefetch if mode == "proactive" else (),
                                  victims=victims, can_evict=can_evict,
                                  drop=mode == "recompute")
        self._apply(decision, step, table)
        if not batch.entries and not self._inflight and batch.focus is not None:
            self._unstick(batch.focus, step, table)

    def _unstick(self, focus: str, step: int, table: EnstTable | None) -> None:
        """Nothing can run and nothing is in flight: make room for the top deferred job by
        evicting any other idle job (pins ignored; dropped if the host is full), and bring it
        in if it is on the host. This is the no-deadlock guarantee: the focus job runs within
        two decisions."""
        job = self._jobs[focus]
        need = self.kv.device_blocks_needed(focus, job.next_context_len)
        with self.queues.ordered("evictable", self._score(table, -1.0)) as victims:
            decision = plan_swaps(self.kv, keep_free=need, wanted={}, prefetch=(),
                                  victims=victims, can_evict=lambda j: j != focus,
                                  drop=self.kv_config.swap_mode == "recompute",
                                  drop_when_host_full=True)
        if decision:
            self.totals["stall_breaks"] += 1
            self._stall_dropped = bool(decision.drop) and job.admitted
        self._apply(decision, step, table)
        if (self.kv.residency(focus) is Residency.HOST
                and self.kv.num_blocks(focus) <= self.kv.num_free_device):
            self._apply(SwapDecision(swap_in=[focus]), step, table)

    def _evict(self, job_id: str, step: int) -> bool:
        """Evict one idle resident job for ``step`` (FCFS growth preemption): swap it out, or
        drop it in recompute mode or when the host is full. True when its blocks are free now."""
        drop = (self.kv_config.swap_mode == "recompute"
                or self.kv.num_blocks(job_id) > self.kv.num_free_host)
        decision = SwapDecision(drop=[job_id]) if drop else SwapDecision(swap_out=[job_id])
        self._apply(decision, step, None)
        return drop

    def _apply(self, decision: SwapDecision, step: int, table: EnstTable | None) -> None:
        for job_id in decision.swap_in:
            job = self._predict(job_id, table)
            self._unplace(job)
            self._step_in.append(self.kv.swap_in(job_id, step))
            job.pinned = True
            self._count_swap(job, "swaps_in")
            self._place(job)   # in transit: only the starvation clock keeps running
        for job_id in decision.swap_out:
            job = self._predict(job_id, table)
            self._unplace(job)
            self._step_out.append(self.kv.swap_out(job_id, step))
            job.pinned = False
            self._count_swap(job, "swaps_out")
            self._place(job)
        for job_id in decision.drop:
            job = self._predict(job_id, table)
            self._unplace(job)
            self.kv.drop(job_id)
            job.state = JobState.WAITING    # recompute: its next iteration is a prefill
            job.pinned = False
            self._count_swap(job, "recomputes")
            self._dropped = True
            self._place(job)

    def _predict(self, job_id: str, table: EnstTable | None) -> Job:
        """Record the ENST predicted at a swap decision (checked when the job next runs)."""
        job = self._jobs[job_id]
        if table is not None:
            job.predictions.append((table.now, table(job.level, job.last_served)))
        return job

    def _score(self, table: EnstTable | None, sign: float) -> LevelScore | None:
        if table is None:
            return None
        jobs = self._jobs
        return lambda level, job_id: sign * table(level, jobs[job_id].last_served)

    def _note_arrival(self, now: float, prompt_blocks: int) -> None:
        if self.kv_config.adaptive_reserve:
            self._arrivals.append((now, prompt_blocks))
            self._arrival_blocks += prompt_blocks
            self._forget_arrivals(now)

    def _forget_arrivals(self, now: float) -> None:
        horizon = now - self.kv_config.adaptive_window_s
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._arrival_blocks -= self._arrivals.popleft()[1]

    def reserve_blocks(self, now: float) -> int:
        """Burst slots: the configured count plus, optionally, blocks sized from the arrivals of
        the last ``adaptive_window_s`` (their prompts, or a configured blocks-per-arrival),
        capped at ``adaptive_max_fraction`` of the device pool."""
        cfg = self.kv_config
        if not cfg.adaptive_reserve:
            return cfg.reserved_blocks
        self._forget_arrivals(now)
        if cfg.adaptive_blocks_per_arrival is None:
            adaptive = float(self._arrival_blocks)
        else:
            adaptive = len(self._arrivals) * cfg.adaptive_blocks_per_arrival
        cap = math.floor(cfg.adaptive_max_fraction * cfg.num_device_blocks)
        return cfg.reserved_blocks + min(math.ceil(adaptive), cap)
