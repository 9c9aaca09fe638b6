"""``Filing``: the named transitions a job's state goes through, and keeping every idle job in
the candidate sets (``fastserve.scheduler.queues``) its state and residency call for.

The base of ``Applier`` (``fastserve.scheduler.apply``), the only writer of job state: these are the
steps its decisions and results are made of, kept apart so that each is written once.
"""

from __future__ import annotations

from fastserve.kv.manager import Residency
from fastserve.scheduler.job import Job, JobState
from fastserve.scheduler.state import SchedulerState
from fastserve.worker.messages import FinishReason


class Filing:
    def __init__(self, state: SchedulerState) -> None:
        self.s = state

    def _set_level(self, job: Job, level: int) -> None:
        """Enter ``level`` at its back (FIFO by time of entering), with no service yet."""
        if job.level_seq:   # 0 until the job first joins a level (level_seq counts from 1)
            self.s.queues.leave(job.level)
        job.level = level
        job.level_seq = next(self.s.level_seq) + 1
        job.attained_s = 0.0
        self.s.queues.join(level)

    def _place(self, job: Job) -> None:
        """Put an idle job in the candidate sets its state and residency call for."""
        s = self.s
        lv = s.queues.level(job.level)
        policy = s.policy
        if job.state is JobState.WAITING:
            lv.pending.add(job.job_id, policy.order_key(job))
        elif job.state is JobState.RUNNABLE:
            where = s.kv.residency(job.job_id)
            if where is Residency.RESIDENT:
                lv.ready.add(job.job_id, policy.order_key(job))
                lv.evictable.add(job.job_id, policy.victim_key(job))
            elif where is Residency.HOST:
                lv.pending.add(job.job_id, policy.order_key(job))
                lv.onhost.add(job.job_id, policy.prefetch_key(job))
        else:
            return
        if policy.may_be_promoted(job):
            if job.starve_due is None:
                # Its wait begins: α for the backlog ahead of it now, fixed for this wait (a
                # backlog that drains later does not make a long wait look like starvation).
                wait = policy.starvation_wait(job.stats.promotions, s.alpha(job.level))
                job.starve_due = job.last_served + wait
            s.queues.starving.add(job.job_id, job.starve_due)

    def _unplace(self, job: Job) -> None:
        self.s.queues.discard(job.level, job.job_id)

    def _count(self, job: Job, what: str) -> None:
        setattr(job.stats, what, getattr(job.stats, what) + 1)
        self.s.totals[what] += 1

    def _to_waiting(self, job: Job, counted_as: str, level: int | None = None) -> None:
        """The job's KV is gone (dropped, lost or wasted): it waits for a first iteration again,
        which recomputes its prompt and the tokens it has — in ``level`` if it moves."""
        self._unplace(job)
        job.state = JobState.WAITING
        job.num_computed_tokens = 0
        job.pinned_until = None
        self._count(job, counted_as)
        if level is not None:
            self._set_level(job, level)
            self._count(job, "demotions")
        self._place(job)

    def _admit(self, job: Job) -> None:
        if not job.admitted:
            job.admitted = True
            job.admit_seq = next(self.s.admit_seq)
            self.s.num_unadmitted -= 1

    def _begin_blocked(self, job: Job, now: float) -> None:
        """A decision wants ``job`` and its KV is not on the device (on the host, or a cached
        prefix being fetched): its wait for device space begins, unless it already has."""
        if job.blocked_since is None:
            job.blocked_since = now
            self.s.blocked.add(job.job_id)

    def _end_blocked(self, job: Job, now: float) -> None:
        if job.blocked_since is not None:
            waited = now - job.blocked_since
            job.blocked_s += waited
            job.stats.longest_swap_blocked_s = max(job.stats.longest_swap_blocked_s, waited)
            job.blocked_since = None
            self.s.blocked.discard(job.job_id)

    def _retire(self, job: Job, state: JobState, reason: FinishReason, now: float) -> None:
        """Take a job out of the queues for good; free its KV (deferred while in flight)."""
        s = self.s
        self._unplace(job)
        s.queues.leave(job.level)
        if not job.admitted:
            s.num_unadmitted -= 1
        job.state = state
        s.kv.free(job.job_id)
        job.stats.finish_time = now
        job.stats.finish_reason = reason
        s.finished.append(job.stats)
        del s.jobs[job.job_id]
