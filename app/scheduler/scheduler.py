"""``Scheduler``: one interface for every policy — add, abort, schedule, update.

Owns the jobs and their state (the only writer of ``Job.state``, level and service), the level
queues, in-flight plans and the per-decision flow of paper Algorithm 1:

    schedule(now): promote starved jobs → form a batch (``BatchBuilder``) → plan swaps
                   (``app.kv.swap_planner``, ENST-ordered) → ``BatchPlan``
    update(plan, output, now): settle the plan's swaps and frees, append tokens, finish jobs,
                   charge the step's duration to each entry's quantum, demote.

Pipelining (paper §4.3): ``schedule`` may be called again while earlier plans are in flight; a
job in an in-flight plan stays in its queue marked RUNNING and is never in two plans; updates may
arrive after later schedules. Memory is the ``KVCacheManager``'s; this module only asks it.
"""

from __future__ import annotations

from actors.messages import BatchPlan, FinishReason, StepOutput
from app.scheduler.batcher import BatchBuilder
from app.scheduler.config import KVCacheConfig, SchedulerConfig
from app.scheduler.job import Job, JobRequest, JobState, TokenDelta
from app.scheduler.memory import MemoryPlanner
from app.scheduler.policies import SkipJoinMLFQ
from app.scheduler.profile import Profile
from app.scheduler.state import InFlight


class AdmissionQueueFull(RuntimeError):
    """Too many jobs wait for admission; the HTTP layer answers 429."""


class Scheduler(MemoryPlanner):
    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig, profile: Profile,
                 eos_token_id: int) -> None:
        super().__init__(config, kv_config, profile, eos_token_id)
        self._builder = BatchBuilder(config, kv_config, self.policy, self.queues, self.kv,
                                     self._jobs, self._evict)

    # ---- intake --------------------------------------------------------------------------
    def add(self, job_or_request: Job | JobRequest, now: float) -> Job:
        """Queue a new job (skip-join: its level comes from the profiled t_init).

        Raises ``ValueError`` for a job that can never run and ``AdmissionQueueFull`` when the
        admission queue is at its configured limit.
        """
        req = job_or_request
        job = req if isinstance(req, Job) else Job(
            req.job_id, tuple(req.prompt_ids), req.sampling,
            now if req.arrival is None else req.arrival, req.priority)
        if job.job_id in self._jobs:
            raise ValueError(f"job id {job.job_id!r} is already queued")
        if not job.prompt_ids:
            raise ValueError(f"job {job.job_id}: prompt is empty")
        job.sampling.validate()
        peak = self.kv.blocks_for(job.prompt_len + job.sampling.max_tokens - 1)
        if peak > self.kv_config.num_device_blocks:
            raise ValueError(
                f"job {job.job_id}: prompt {job.prompt_len} + max_tokens "
                f"{job.sampling.max_tokens} needs {peak} KV blocks, the device pool has "
                f"{self.kv_config.num_device_blocks}")
        if self._num_unadmitted >= self.config.admission_queue_limit:
            raise AdmissionQueueFull(
                f"{self._num_unadmitted} jobs already wait for admission "
                f"(admission_queue_limit={self.config.admission_queue_limit})")
        job.seq = next(self._seq)
        job.state = JobState.WAITING
        self._jobs[job.job_id] = job
        self._num_unadmitted += 1
        self._set_level(job, self._entry_level(job))
        self._place(job)
        self._note_arrival(now, self.kv.blocks_for(job.prompt_len))
        self.totals["added"] += 1
        return job

    def _entry_level(self, job: Job) -> int:
        """The policy's entry level (skip-join for MLFQ), shifted by the request's priority."""
        return min(max(1, self.policy.entry_level(job) + job.priority), self.policy.num_levels())

    def abort(self, job_id: str, now: float) -> None:
        """Cancel a job. Its blocks are freed now, or when the in-flight step or swap that
        touches them completes."""
        job = self._jobs.get(job_id)
        if job is None or not job.active:
            return
        running = job.state is JobState.RUNNING
        if not running:
            job.stats.queueing_s += now - job.idle_since
        self._retire(job, JobState.ABORTED, "abort", now)
        if running:
            self._jobs[job_id] = job   # forgotten at the update of its plan
        self.totals["aborted"] += 1

    # ---- decision ------------------------------------------------------------------------
    def schedule(self, now: float) -> BatchPlan | None:
        """Pick the next iteration's batch and its swaps; None when there is nothing to do."""
        if self.policy.starvation:
            self._promote_starved(now)
        step = self._next_step
        self._step_out = []
        self._step_in = []
        # A drop frees blocks at once, so a decision that only dropped is retried at once
        # instead of idling a step. If the stall breaker dropped KV to unblock an admitted job,
        # the retry keeps new jobs out: admission waits while both tiers are full.
        admit_new = True
        for _ in range(2):
            self._dropped = self._stall_dropped = False
            batch = self._builder.build(step, admit_new)
            for job in batch.selected:   # running from here on: no longer a swap candidate
                self._start(job, now)
            for cmd in batch.swap_in:
                self._count_swap(self._jobs[cmd.job_id], "swaps_in")
            self._step_in += batch.swap_in
            self._plan_memory(batch, now, step)
            if batch.entries or self._step_out or self._step_in or not self._dropped:
                break
            admit_new = not self._stall_dropped
        if not batch.entries and not self._step_out and not self._step_in:
            return None
        self._next_step += 1
        plan = BatchPlan(step, tuple(batch.entries), tuple(self._step_out),
                         tuple(self._step_in), tuple(self._to_free))
        self._to_free.clear()
        self._inflight[step] = InFlight(now, tuple(e.job_id for e in batch.entries),
                                         frozenset(c.job_id for c in batch.swap_in))
        self.totals["steps"] += 1
        return plan

    def _start(self, job: Job, now: float) -> None:
        self._unplace(job)
        if not job.admitted:
            job.admitted = True
            job.admit_seq = next(self._admit_seq)
            self._num_unadmitted -= 1
        job.state = JobState.RUNNING
        blocked = 0.0 if job.blocked_since is None else now - job.blocked_since
        job.stats.swap_blocked_s += blocked
        job.stats.queueing_s += max(now - job.idle_since - blocked, 0.0)
        job.blocked_since = None
        job.pinned = False
        for made_at, predicted in job.predictions:
            job.stats.enst_pairs.append((predicted, now - made_at))
        job.predictions.clear()

    def _promote_starved(self, now: float) -> None:
        """Starvation prevention: a job not served for longer than α goes to level 1."""
        alpha = self.config.starvation_alpha_s
        while (top := self.queues.starving.peek()) is not None and now - top[0] > alpha:
            job = self._jobs[top[1]]
            self._unplace(job)
            self._set_level(job, 1)
            job.last_served = now   # the starve clock restarts with the promotion
            job.stats.promotions += 1
            self.totals["promotions"] += 1
            self._place(job)

    # ---- results -------------------------------------------------------------------------
    def update(self, plan: BatchPlan, output: StepOutput, now: float) -> list[TokenDelta]:
        """Apply one plan's output: tokens, finishes, quanta, demotions, settled swaps."""
        rec = self._inflight.pop(plan.step_id)
        settled = self.kv.complete(plan.step_id)
        duration = output.timings.get("total", now - rec.scheduled_at)
        swap_wait = output.timings.get("swap_wait", 0.0)
        deltas: list[TokenDelta] = []
        for job_id in rec.job_ids:
            job = self._jobs[job_id]
            if job.state is JobState.ABORTED:
                self._forget_aborted(job)
                continue
            token = output.tokens.get(job_id)
            if token is None:
                deltas.append(self._fail_job(job, now))
                continue
            deltas.append(self._advance(job, token, duration,
                                        swap_wait if job_id in rec.reactive else 0.0, now))
        for job_id in settled:
            idle = self._jobs.get(job_id)
            if idle is not None and idle.state is JobState.RUNNABLE:
                self._place(idle)
        return deltas

    def _advance(self, job: Job, token: int, duration: float, swap_wait: float,
                 now: float) -> TokenDelta:
        job.generated.append(token)
        stats = job.stats
        stats.num_generated = len(job.generated)
        if stats.first_token_time is None:
            stats.first_token_time = now
        stats.execution_s += duration - swap_wait
        stats.swap_blocked_s += swap_wait
        job.attained_s += duration
        job.last_served = now
        job.idle_since = now
        reason = job.sampling.finish_reason(token, len(job.generated), self.eos_token_id)
        if reason is not None:
            self._retire(job, JobState.FINISHED, reason, now)
            self.totals["finished"] += 1
            return TokenDelta(job.job_id, token, True, reason)
        job.state = JobState.RUNNABLE
        policy = self.policy
        if (policy.demotes and isinstance(policy, SkipJoinMLFQ)
                and job.attained_s > policy.quantum(job.level)
                and job.level < self.queues.num_levels):
            self._set_level(job, min(job.level + self.config.demotion_eta,
                                     self.queues.num_levels))
            stats.demotions += 1
            self.totals["demotions"] += 1
        self._place(job)
        return TokenDelta(job.job_id, token, False, None)

    def fail(self, plan: BatchPlan, now: float) -> list[TokenDelta]:
        """The executor failed ``plan``: its jobs finish with ``error``; jobs it was swapping
        lose their KV (unknown contents) and will recompute."""
        rec = self._inflight.pop(plan.step_id)
        for job_id in self.kv.fail(plan.step_id):
            job = self._jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNABLE:
                self._unplace(job)
                job.state = JobState.WAITING
                self._count_swap(job, "recomputes")
                self._place(job)
        deltas = []
        for job_id in rec.job_ids:
            job = self._jobs[job_id]
            if job.state is JobState.ABORTED:
                self._forget_aborted(job)
            else:
                deltas.append(self._fail_job(job, now))
        return deltas

    def _fail_job(self, job: Job, now: float) -> TokenDelta:
        self._retire(job, JobState.FINISHED, "error", now)
        self.totals["errors"] += 1
        return TokenDelta(job.job_id, None, True, "error")

    def _retire(self, job: Job, state: JobState, reason: FinishReason, now: float) -> None:
        """Take a job out of the queues for good; free its KV (deferred while in flight)."""
        self._unplace(job)
        self.queues.leave(job.level)
        if not job.admitted:
            self._num_unadmitted -= 1
        running = job.state is JobState.RUNNING
        job.state = state
        self.kv.free(job.job_id)
        if not running:   # the data plane forgets a job once no in-flight plan names it
            self._to_free.append(job.job_id)
        job.stats.finish_time = now
        job.stats.finish_reason = reason
        self._finished.append(job.stats)
        del self._jobs[job.job_id]

    def _forget_aborted(self, job: Job) -> None:
        del self._jobs[job.job_id]
        self._to_free.append(job.job_id)
