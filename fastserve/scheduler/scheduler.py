"""``Scheduler``: one interface for every policy — add, abort, schedule, update.

Composes the state, the pure planners (``BatchPlanner``, ``MemoryPlanner``) and the one writer
(``Applier``). ``schedule`` may run again while earlier plans are in flight (§4.3); a job is never
in two plans, and updates may arrive after later schedules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from fastserve.errors import AdmissionQueueFull, InvalidRequest
from fastserve.kv.manager import KVCacheManager
from fastserve.scheduler.accounting import service_charges
from fastserve.scheduler.apply import Applied, Applier, Served
from fastserve.scheduler.batcher import BatchPlanner
from fastserve.scheduler.checks import check_scheduler, scheduler_stats
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig
from fastserve.scheduler.decision import Decision
from fastserve.scheduler.job import Finish, Job, JobRequest, JobState, JobStats, TokenDelta
from fastserve.scheduler.memory import MemoryPlanner
from fastserve.scheduler.policies import Policy
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.queues import LevelQueues
from fastserve.scheduler.state import SchedulerState, SchedulerView
from fastserve.worker.messages import BatchPlan, StepOutput

#: A plan that only dropped KV is re-planned once, on the blocks the drops freed.
_PLAN_PASSES = 2


class Scheduler:
    """One model copy's scheduler, driven by ``EngineCore``."""

    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig, profile: Profile,
                 eos_token_ids: frozenset[int]) -> None:
        self.state = SchedulerState(config, kv_config, profile, eos_token_ids)
        self.view = SchedulerView(self.state)
        self.applier = Applier(self.state)
        self.batcher = BatchPlanner(self.view)
        self.memory = MemoryPlanner(self.view)
        # The state's own objects, for callers to read (only the Applier writes).
        self.config: SchedulerConfig = self.state.config
        self.kv_config: KVCacheConfig = self.state.kv_config
        self.profile: Profile = self.state.profile
        self.policy: Policy = self.state.policy
        self.kv: KVCacheManager = self.state.kv
        self.queues: LevelQueues = self.state.queues
        self.eos_token_ids: frozenset[int] = self.state.eos_token_ids
        self.totals: Counter[str] = self.state.totals

    def jobs(self) -> Mapping[str, Job]:
        return self.view.jobs

    def has_work(self) -> bool:
        return bool(self.state.jobs) or bool(self.state.inflight)

    def num_waiting(self) -> int:
        return self.state.num_unadmitted

    def num_inflight(self) -> int:
        return len(self.state.inflight)

    def starvation_alpha(self) -> float:
        return self.view.alpha()

    def enst(self, job_id: str, now: float) -> float | None:
        table = self.view.enst_table(now)
        job = self.state.jobs[job_id]
        return None if table is None else table(job.level, job.starve_due)

    def reserve_blocks(self, now: float) -> int:
        return self.view.reserve_blocks(now)

    def drain_finished(self) -> list[JobStats]:
        out = list(self.state.finished)
        self.state.finished.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return scheduler_stats(self.state)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (jobs keep their own); returns how many were cached."""
        return self.state.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        check_scheduler(self.state)

    def add(self, job_or_request: Job | JobRequest, now: float) -> Job:
        """Queue a new job; ``InvalidRequest`` if the pool can never hold it (or a duplicate id),
        ``AdmissionQueueFull`` at the limit. The request itself was validated at the ingress."""
        req = job_or_request
        job = req if isinstance(req, Job) else Job(
            req.job_id, tuple(req.prompt_ids), req.sampling,
            now if req.arrival is None else req.arrival, req.priority)
        s = self.state
        if job.job_id in s.jobs:
            raise InvalidRequest(f"job id {job.job_id!r} is already queued")
        peak = s.kv.blocks_for(job.prompt_len + job.sampling.max_tokens - 1)
        if peak > s.kv_config.num_device_blocks:
            raise InvalidRequest(
                f"job {job.job_id}: prompt {job.prompt_len} + max_tokens "
                f"{job.sampling.max_tokens} needs {peak} KV blocks, the device pool has "
                f"{s.kv_config.num_device_blocks}")
        if s.num_unadmitted >= s.config.admission_queue_limit:
            raise AdmissionQueueFull(
                f"{s.num_unadmitted} jobs already wait for admission "
                f"(admission_queue_limit={s.config.admission_queue_limit})")
        if isinstance(req, JobRequest) and req.cache_salt is not None:
            s.kv.prefix.salt(job.job_id, req.cache_salt)   # before the lookup: its chain starts there
        job.cached_at_arrival = s.kv.prefix_hit(job.job_id, job.prompt_len, job.tokens).tokens
        self.applier.add(job, self._entry_level(job), now)
        return job

    def _entry_level(self, job: Job) -> int:
        policy = self.policy
        return min(max(1, policy.entry_level(job) + job.priority), policy.num_levels())

    def abort(self, job_id: str, now: float) -> None:
        """Cancel a job; its blocks are freed now, or when the step or swap touching them completes."""
        job = self.state.jobs.get(job_id)
        if job is not None and job.active:
            self.applier.abort(job, now)

    def schedule(self, now: float) -> BatchPlan | None:
        s = self.state
        self._promote_starved(now)
        step = s.next_step
        out = Applied()
        # After the stall breaker dropped KV for an admitted job, new jobs stay out of the rerun.
        admit_new = True
        for _ in range(_PLAN_PASSES):
            decision = self._plan(step, now, admit_new)
            focus = decision.batch.focus
            stall_dropped = bool(decision.unstick.drop) and focus is not None \
                and s.jobs[focus].admitted
            self.applier.apply(decision, now, out)
            if out.entries or out.swap_out or out.swap_in or not decision.dropped:
                break
            admit_new = not stall_dropped
        if not out.entries and not out.swap_out and not out.swap_in:
            return None
        return self.applier.dispatch(step, now, out)

    def _plan(self, step: int, now: float, admit_new: bool) -> Decision:
        batch = self.batcher.plan(step, admit_new)
        table = self.view.enst_table(now)
        swaps = self.memory.plan(batch, step, now, table)
        unstick = self.memory.plan_unstick(batch, swaps, table)
        return Decision(step, batch, swaps, unstick, table)

    def _promote_starved(self, now: float) -> None:
        """Promote jobs past their α; α is re-read when due and a promotion postponed if the
        backlog grew, so α never falls while a job waits and a burst is no promotion storm."""
        s, policy = self.state, self.policy
        while (job_id := self.queues.starving.first_overdue(now)) is not None:
            job = s.jobs[job_id]
            due = job.last_served + policy.starvation_wait(job.stats.promotions, s.alpha(job.level))
            if due > now:
                self.applier.postpone(job, due)
                continue
            level = policy.promotion_level(job)
            assert level is not None, f"{job_id} is overdue but the policy does not promote it"
            self.applier.promote(job, level, now)

    def update(self, plan: BatchPlan, output: StepOutput, now: float) -> list[TokenDelta]:
        s = self.state
        timings = output.timings
        duration = timings.get("total", now - s.inflight[plan.step_id].scheduled_at)
        swap_wait = timings.get("swap_wait", 0.0)
        rec, settled = self.applier.complete(plan.step_id, duration if plan.entries else None)
        shares = service_charges(plan.entries, s.profile)
        deltas: list[TokenDelta] = []
        for job_id in rec.job_ids:
            job = s.jobs[job_id]
            if job.state is JobState.ABORTED:
                self.applier.forget_aborted(job)
                continue
            # A forward that waited for a swap stalled every entry of the batch.
            served = Served(shares[job_id], duration, swap_wait)
            chunk_end = rec.chunks.get(job_id)
            if chunk_end is not None:   # a prefill chunk short of the last: no token
                self.applier.chunk_done(job, chunk_end, served, now)
                continue
            token = output.tokens.get(job_id)
            if token is None:
                deltas.append(self._fail_job(job, now))
                continue
            if job_id in rec.wasted:
                self.applier.waste(job, served, now)
                continue
            reason = self.applier.advance(job, token, served, now)
            finish = Finish(reason, job.stats) if reason is not None else None
            deltas.append(TokenDelta.token(job_id, token, finish, output.logprobs.get(job_id)))
        self.applier.settle(settled, now)
        return deltas

    def fail(self, plan: BatchPlan, now: float) -> list[TokenDelta]:
        """``plan`` failed: its jobs end with ``error``; those it was swapping will recompute."""
        s = self.state
        rec = self.applier.fail_step(plan.step_id)
        deltas = []
        for job_id in rec.job_ids:
            job = s.jobs[job_id]
            if job.state is JobState.ABORTED:
                self.applier.forget_aborted(job)
            else:
                deltas.append(self._fail_job(job, now))
        return deltas

    def lose_all_kv(self, plans: list[BatchPlan]) -> None:
        """Every worker's KV is gone (pipeline rebuilt): every job recomputes, none fails."""
        self.applier.lose_all_kv([p.step_id for p in plans])

    def fail_all(self, now: float) -> list[TokenDelta]:
        s = self.state
        self.applier.void_inflight()
        deltas = []
        for job in list(s.jobs.values()):
            if job.state is JobState.ABORTED:
                self.applier.forget_aborted(job)
            else:
                deltas.append(self._fail_job(job, now))
        return deltas

    def _fail_job(self, job: Job, now: float) -> TokenDelta:
        self.applier.fail_job(job, now)
        return TokenDelta.ended(job.job_id, "error", job.stats)
