"""``Scheduler``: one interface for every policy — add, abort, schedule, update.

Composes the scheduler's parts: its state (``SchedulerState``) and read-only view, the pure
planners (``BatchPlanner``, ``MemoryPlanner``) and the one writer (``Applier``). Each decision
of paper Algorithm 1 reads as

    schedule(now): promote starved jobs → plan (batch, swaps, stall breaker) → apply → BatchPlan
    update(plan, output, now): settle the plan's swaps, append tokens, finish jobs, charge each
                   entry its own share of the step, demote (policy methods decide the levels).
                   A prefill chunk that is not its job's last (chunked prefill) appends no
                   token: it only moves the job's ``num_computed_tokens`` and is charged as service.

Pipelining (paper §4.3): ``schedule`` may be called again while earlier plans are in flight; a
job in an in-flight plan stays in its queue marked RUNNING and is never in two plans; updates may
arrive after later schedules. Memory is the ``KVCacheManager``'s; planners only read its counts.
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

#: A plan that only dropped KV is re-planned at once (the drops freed blocks); once is enough.
_PLAN_PASSES = 2


class Scheduler:
    """One model copy's scheduler. ``EngineCore`` drives the step's four methods (``add``,
    ``abort``, ``schedule``, ``update``); ``fail``, ``lose_all_kv`` and ``fail_all`` end a failed
    step or a lost data plane; ``reset_prefix_cache`` is the operator's; the rest are reads for
    the replica's metrics, ``/debug/engine``, the simulator and the tests."""

    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig, profile: Profile,
                 eos_token_ids: frozenset[int]) -> None:
        self.state = SchedulerState(config, kv_config, profile, eos_token_ids)
        self.view = SchedulerView(self.state)
        self.applier = Applier(self.state)
        self.batcher = BatchPlanner(self.view)
        self.memory = MemoryPlanner(self.view)
        # What callers read (the state's own objects, never rebound; only the Applier writes).
        self.config: SchedulerConfig = self.state.config
        self.kv_config: KVCacheConfig = self.state.kv_config
        self.profile: Profile = self.state.profile
        self.policy: Policy = self.state.policy
        self.kv: KVCacheManager = self.state.kv
        self.queues: LevelQueues = self.state.queues
        self.eos_token_ids: frozenset[int] = self.state.eos_token_ids
        self.totals: Counter[str] = self.state.totals

    # ---- what callers read ---------------------------------------------------------------

    def jobs(self) -> Mapping[str, Job]:
        """Read-only view of the jobs the scheduler holds (for metrics and tests)."""
        return self.view.jobs

    def has_work(self) -> bool:
        return bool(self.state.jobs) or bool(self.state.inflight)

    def num_waiting(self) -> int:
        """Jobs in the admission queue (never given KV)."""
        return self.state.num_unadmitted

    def num_inflight(self) -> int:
        return len(self.state.inflight)

    def starvation_alpha(self) -> float:
        """α in effect now (the configured one, floored at k measured iterations)."""
        return self.view.alpha()

    def enst(self, job_id: str, now: float) -> float | None:
        """ENST of a queued job at ``now`` (None for policies without levels' quanta)."""
        table = self.view.enst_table(now)
        job = self.state.jobs[job_id]
        return None if table is None else table(job.level, job.starve_due)

    def reserve_blocks(self, now: float) -> int:
        return self.view.reserve_blocks(now)

    def drain_finished(self) -> list[JobStats]:
        """Accounting of jobs finished or aborted since the last call."""
        out = list(self.state.finished)
        self.state.finished.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return scheduler_stats(self.state)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (vLLM's ``/reset_prefix_cache``); jobs keep their own.
        Returns how many blocks were cached."""
        return self.state.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if scheduler or KV state is inconsistent (tests: every step)."""
        check_scheduler(self.state)

    # ---- intake --------------------------------------------------------------------------
    def add(self, job_or_request: Job | JobRequest, now: float) -> Job:
        """Queue a new job (skip-join: its level comes from the profiled t_init).

        The request's own validity (prompt, sampling, context) is ``fastserve.errors.validate_request``'s,
        at the ingress. Here only what the scheduler knows: raises ``InvalidRequest`` for a job its
        KV pool can never hold (or a duplicate id) and ``AdmissionQueueFull`` when the admission
        queue is at its configured limit.
        """
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
        if job.sampling.prompt_logprobs is not None:
            s.kv.prefix.never_read(job.job_id)   # every prompt position's logits are computed
        # Skip-join places it by the prompt it must compute: what the prefix cache lacks now.
        job.cached_at_arrival = s.kv.prefix_hit(job.job_id, job.prompt_len, job.tokens).tokens
        self.applier.add(job, self._entry_level(job), now)
        return job

    def _entry_level(self, job: Job) -> int:
        """The policy's entry level (skip-join for MLFQ), shifted by the request's priority."""
        policy = self.policy
        return min(max(1, policy.entry_level(job) + job.priority), policy.num_levels())

    def abort(self, job_id: str, now: float) -> None:
        """Cancel a job. Its blocks are freed now, or when the in-flight step or swap that
        touches them completes."""
        job = self.state.jobs.get(job_id)
        if job is not None and job.active:
            self.applier.abort(job, now)

    # ---- decision ------------------------------------------------------------------------
    def schedule(self, now: float) -> BatchPlan | None:
        """Pick the next iteration's batch and its swaps; None when there is nothing to do."""
        s = self.state
        self._promote_starved(now)
        step = s.next_step
        out = Applied()
        # A drop frees blocks at once, so a decision that only dropped is re-planned at once
        # instead of idling a step. If the stall breaker dropped KV to unblock an admitted job,
        # the second plan keeps new jobs out: admission waits while both tiers are full.
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
        """Batch, then the swaps around it, then the stall breaker: pure, on one snapshot."""
        batch = self.batcher.plan(step, admit_new)
        table = self.view.enst_table(now)
        swaps = self.memory.plan(batch, step, now, table)
        unstick = self.memory.plan_unstick(batch, swaps, table)
        return Decision(step, batch, swaps, unstick, table)

    def _promote_starved(self, now: float) -> None:
        """Starvation prevention: the policy moves a job not served for longer than its α.

        A job's α is fixed when its wait begins, from the backlog ahead of it then; when it
        comes due, α is read again and the promotion postponed if the backlog has grown since
        (a burst: the first jobs of 10,000 arriving at once saw almost nothing ahead). So α
        never falls while a job waits — a backlog that drains does not shorten a wait — and a
        burst does not turn into a storm of promotions."""
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

    # ---- results -------------------------------------------------------------------------
    def update(self, plan: BatchPlan, output: StepOutput, now: float) -> list[TokenDelta]:
        """Apply one plan's output: tokens, finishes, quanta, demotions, settled swaps."""
        s = self.state
        timings = output.timings
        duration = timings.get("total", now - s.inflight[plan.step_id].scheduled_at)
        swap_wait = timings.get("swap_wait", 0.0)
        rec, settled = self.applier.complete(plan.step_id, duration if plan.entries else None)
        shares = service_charges(plan.entries, s.profile)
        starts = {e.job_id: e.start_pos for e in plan.entries if e.prompt_targets}
        deltas: list[TokenDelta] = []
        for job_id in rec.job_ids:
            job = s.jobs[job_id]
            if job.state is JobState.ABORTED:
                self.applier.forget_aborted(job)
                continue
            if job_id in output.prompt_logprobs:
                self.applier.keep_prompt_logprobs(job, starts[job_id], output.prompt_logprobs[job_id])
            # A forward that waited for a swap (a reactive swap-in, or blocks a swap-out of this
            # plan frees for it) stalled every entry of the batch: each was blocked by swapping.
            served = Served(shares[job_id], duration, swap_wait)
            chunk_end = rec.chunks.get(job_id)
            if chunk_end is not None:   # a prefill chunk short of the last: no token (by design)
                self.applier.chunk_done(job, chunk_end, served, now)
                continue
            token = output.tokens.get(job_id)
            if token is None:
                deltas.append(self._fail_job(job, now))
                continue
            if job_id in rec.wasted:
                self.applier.waste(job, served, now)
                continue
            first = not job.generated
            reason = self.applier.advance(job, token, served, now)
            finish = Finish(reason, job.stats) if reason is not None else None
            prompt = tuple(job.prompt_logprobs) if first and job.sampling.prompt_logprobs is not None else None
            deltas.append(TokenDelta.token(job_id, token, finish, output.logprobs.get(job_id), prompt))
        self.applier.settle(settled, now)
        return deltas

    def fail(self, plan: BatchPlan, now: float) -> list[TokenDelta]:
        """The executor failed ``plan``: its jobs finish with ``error``; jobs it was swapping
        lose their KV (unknown contents) and will recompute."""
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
        """Every worker's KV is gone (the pipeline is rebuilt after a worker died): ``plans``
        (those in flight) did nothing; every job recomputes on the new workers, none fails."""
        self.applier.lose_all_kv([p.step_id for p in plans])

    def fail_all(self, now: float) -> list[TokenDelta]:
        """End every job with ``error`` (the data plane could not be rebuilt in time)."""
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
