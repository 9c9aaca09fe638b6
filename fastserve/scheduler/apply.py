"""``Applier``: the only writer of job and KV-manager state.

Runs what the planners decided (``apply``: blocks for the batch's runs, evictions, swaps, the
stall breaker) and what an executor reported (``advance``, ``waste``, ``abort``, ``settle``),
through a few named transitions of a job (``_to_waiting``, ``_start``, ``_retire``, ...), each
written once, and keeps every idle job filed in the candidate sets
(``fastserve.scheduler.queues``) its state and residency call for (``_place``). The decisions
themselves are made elsewhere (``batcher``, ``memory``, the policy's demotion and promotion).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from fastserve.kv.enst import EnstTable
from fastserve.kv.manager import Residency, Tier
from fastserve.kv.swap_planner import SwapDecision
from fastserve.scheduler.decision import Decision, Evict, Fetch, Run
from fastserve.scheduler.job import Job, JobState
from fastserve.scheduler.state import InFlight, SchedulerState
from fastserve.worker.messages import BatchEntry, BatchPlan, FinishReason, SwapCommand, TokenLogprobs


@dataclass(frozen=True)
class Served:
    """One job's part of a returned step."""

    share_s: float        # its service (quantum accounting, ``fastserve.scheduler.accounting``)
    wall_s: float         # the step's duration, which the job spent in it (latency breakdown)
    swap_wait_s: float    # of which the step's forward waited for swaps (the whole batch stalled)


@dataclass
class Applied:
    """What one applied decision hands the data plane."""

    entries: list[BatchEntry] = field(default_factory=list)
    swap_out: list[SwapCommand] = field(default_factory=list)
    swap_in: list[SwapCommand] = field(default_factory=list)
    wasted: set[str] = field(default_factory=set)
    chunks: dict[str, int] = field(default_factory=dict)   # non-final prefill chunks: their end


class Applier:
    def __init__(self, state: SchedulerState) -> None:
        self.s = state

    # ---- intake and promotion ------------------------------------------------------------
    def add(self, job: Job, level: int, now: float) -> None:
        s = self.s
        job.seq = next(s.seq)
        job.state = JobState.WAITING
        s.jobs[job.job_id] = job
        s.num_unadmitted += 1
        self._set_level(job, level)
        self._place(job)
        s.reserve.note_arrival(now, s.kv.blocks_for(job.prompt_len))
        s.totals["added"] += 1

    def promote(self, job: Job, level: int, now: float) -> None:
        self._unplace(job)
        self._set_level(job, level)
        job.last_served = now   # the starve clock restarts with the promotion
        job.starve_due = None
        job.promoted = True
        self._count(job, "promotions")
        self._place(job)

    def postpone(self, job: Job, due: float) -> None:
        """The job's wait, checked when it came due, is not over: the backlog ahead of it grew
        since the wait began, and its promotion moves to ``due`` (later, never earlier)."""
        assert job.starve_due is not None and due > job.starve_due
        job.starve_due = due
        self.s.queues.starving.add(job.job_id, due)
        self.s.totals["promotions_postponed"] += 1

    # ---- a decision ----------------------------------------------------------------------
    def apply(self, decision: Decision, now: float, out: Applied) -> None:
        """Run ``decision``: evictions and runs in the order decided, then its swaps, then the
        stall breaker; commands and entries accumulate in ``out``."""
        s = self.s
        step, table = decision.step, decision.table
        for action in decision.batch.actions:
            if isinstance(action, Evict):
                self._evict(action, step, table, out)
            elif isinstance(action, Fetch):
                self._fetch(s.jobs[action.job_id], action.host_hits, step, now, out)
            else:
                self._run(action, step, now, out)
        self._refresh_blocked(decision.batch.wanted_host, now)
        s.claims = decision.batch.claims
        self._swap(decision.swaps, step, table, out)
        if decision.unstick.swap_out or decision.unstick.drop:
            s.totals["stall_breaks"] += 1
        self._swap(decision.unstick, step, table, out)
        # Cached device blocks this decision's allocations evicted: to the host with this plan.
        spill = s.kv.flush_evicted(step)
        if spill is not None:
            out.swap_out.append(spill)

    def _refresh_blocked(self, wanted: Mapping[str, int], now: float) -> None:
        """A job waits for device space while a batch wants it and its KV is not there. Once a
        batch no longer wants it (outranked since) and no copy of its is under way, the wait is
        over: from then on it waits in its queue, like any job the batch did not pick."""
        s = self.s
        for job_id in list(s.blocked):
            job = s.jobs.get(job_id)
            if job is None or job.blocked_since is None:
                s.blocked.discard(job_id)
            elif job_id not in wanted and s.kv.swap_step(job_id) is None:
                self._end_blocked(job, now)
        for job_id in wanted:
            self._begin_blocked(s.jobs[job_id], now)

    def dispatch(self, step: int, now: float, out: Applied) -> BatchPlan:
        """The applied decision becomes plan ``step``, in flight until ``complete`` or a fail."""
        s = self.s
        s.next_step = step + 1
        s.inflight[step] = InFlight(now, tuple(e.job_id for e in out.entries),
                                    frozenset(out.wasted), out.chunks)
        s.totals["steps"] += 1
        return BatchPlan(step, tuple(out.entries), tuple(out.swap_out), tuple(out.swap_in))

    def _run(self, run: Run, step: int, now: float, out: Applied) -> None:
        s = self.s
        job = s.jobs[run.job_id]
        if run.swap_in_first:
            out.swap_in.append(s.kv.swap_in(job.job_id, step))
            self._count(job, "swaps_in")
        # A first iteration in chunks takes the blocks of all of it with its first chunk; a run
        # the policy cuts short takes only what it feeds (its KV is dropped after it).
        whole = run.end if run.wasted else job.num_tokens
        if not run.wasted and s.kv.tier(job.job_id) is Tier.NONE:
            cached, fetch = s.kv.admit(job.job_id, whole, step, job.tokens, runs=True,
                                       max_host=run.host_hits)
            if cached < run.start:
                # An earlier action of this decision took a cached block the walk counted as
                # this job's hit (it evicts the least recently used): compute from what is
                # still cached, as many tokens as planned — a prefill chunk if short of the end.
                run = replace(run, start=cached, end=min(cached + run.fed_tokens, whole))
            if fetch is not None:   # host hits: the forward waits for the copy
                out.swap_in.append(fetch)
            self._note_prefix(job, whole, cached)
            job.num_computed_tokens = cached   # the cached prefix counts as computed
            table = s.kv.block_table(job.job_id)
        else:
            table = s.kv.allocate(job.job_id, whole, step)
        # It samples when the run reaches its end (a cut first iteration samples a token that is
        # discarded); a prefill chunk short of it samples nothing.
        samples = run.wasted or run.end == job.num_tokens
        context = (job.sampling.context(job.prompt_ids, job.generated, s.eos_token_ids)
                   if samples else None)
        out.entries.append(BatchEntry(job.job_id, job.tokens()[run.start:run.end], run.start,
                                      table, not job.decoding, job.sampling,
                                      len(job.generated), samples, context,
                                      job.prompt_targets(run.start, run.end)))
        if not samples:
            out.chunks[job.job_id] = run.end
        if run.wasted:
            out.wasted.add(job.job_id)
        self._start(job, now)

    def _fetch(self, job: Job, host_hits: int, step: int, now: float, out: Applied) -> None:
        """Prefix caching: admit a job whose cached prefix is partly on the host; the copy goes
        with this plan, and the job runs the rest of its prompt once it landed."""
        s = self.s
        whole = job.num_tokens
        if not s.kv.prefix_hit(job.job_id, whole, job.tokens, host_hits).tokens:
            # An earlier action of this decision took the cached blocks (evicted them to take
            # blocks): nothing to fetch; it is admitted as a new job at a later decision.
            return
        cached, fetch = s.kv.admit(job.job_id, whole, step, job.tokens, runs=False,
                                   max_host=host_hits)
        if fetch is not None:
            out.swap_in.append(fetch)
        self._note_prefix(job, whole, cached)
        self._unplace(job)
        self._admit(job)
        job.state = JobState.RUNNABLE
        job.num_computed_tokens = cached   # its next run computes from here, as after a chunk
        self._begin_blocked(job, now)
        s.totals["prefix_fetches"] += 1
        self._place(job)            # in transit: only the starvation clock keeps running

    def _note_prefix(self, job: Job, queried: int, cached: int) -> None:
        if not self.s.kv.prefix.enabled:
            return
        if not job.admitted:
            job.stats.cached_tokens = cached
        self.s.totals["prefix_cache_queries"] += queried
        self.s.totals["prefix_cache_hits"] += cached

    def _start(self, job: Job, now: float) -> None:
        self._unplace(job)
        self._admit(job)
        job.state = JobState.RUNNING
        self._end_blocked(job, now)
        job.stats.swap_blocked_s += job.blocked_s
        job.stats.queueing_s += max(now - job.idle_since - job.blocked_s, 0.0)
        job.blocked_s = 0.0
        job.pinned_until = None
        job.promoted = False
        for made_at, predicted in job.predictions:
            job.stats.enst_pairs.append((predicted, now - made_at))
        job.predictions.clear()

    def _swap(self, decision: SwapDecision, step: int, table: EnstTable | None,
              out: Applied) -> None:
        # Drops first: their blocks are free at once, and a swap-in may be planned into them.
        for job_id in decision.drop:
            self._drop(job_id, table)
        for job_id in decision.swap_in:
            job = self._predict(job_id, table)
            self._unplace(job)
            out.swap_in.append(self.s.kv.swap_in(job_id, step))
            # Pinned while in transit; ``settle`` sets how long it stays pinned once it landed.
            job.pinned_until = step + self.s.kv_config.swap_pin_plans
            self._count(job, "swaps_in")
            self._place(job)   # in transit: only the starvation clock keeps running
        for job_id in decision.swap_out:
            self._swap_out(job_id, step, table, out, reuse_now=False)

    def _evict(self, action: Evict, step: int, table: EnstTable | None, out: Applied) -> None:
        self.s.totals["preemptions"] += 1    # for a job the batch wants (the rest: the swap plan)
        if action.drop:
            self._drop(action.job_id, table)
        else:
            self._swap_out(action.job_id, step, table, out, action.reuse_now)

    def _drop(self, job_id: str, table: EnstTable | None) -> None:
        job = self._predict(job_id, table)
        self.s.kv.drop(job_id)
        self._to_waiting(job, "recomputes")

    def _swap_out(self, job_id: str, step: int, table: EnstTable | None, out: Applied,
                  reuse_now: bool) -> None:
        job = self._predict(job_id, table)
        self._unplace(job)
        out.swap_out.append(self.s.kv.swap_out(job_id, step, reuse_now=reuse_now))
        job.pinned_until = None
        self._count(job, "swaps_out")
        self._place(job)

    def _predict(self, job_id: str, table: EnstTable | None) -> Job:
        """Record the ENST predicted at a swap decision (checked when the job next runs)."""
        job = self.s.jobs[job_id]
        if table is not None:
            job.predictions.append((table.now, table(job.level, job.starve_due)))
        return job

    # ---- results -------------------------------------------------------------------------
    def advance(self, job: Job, token: int, served: Served, now: float) -> FinishReason | None:
        """A token for ``job``; returns why it finished (it is then retired), or None."""
        job.num_computed_tokens = job.num_tokens   # every position it fed has KV now
        job.generated.append(token)
        self.s.kv.commit(job.job_id, job.num_computed_tokens, job.tokens)
        stats = job.stats
        stats.num_generated = len(job.generated)
        if stats.first_token_time is None:
            stats.first_token_time = now
        self._served(job, served, now)
        reason = job.sampling.finish_reason(token, len(job.generated), self.s.eos_token_ids)
        if reason is not None:
            self._retire(job, JobState.FINISHED, reason, now)
            self.s.totals["finished"] += 1
            return reason
        self._idle_after_run(job)
        return None

    def keep_prompt_logprobs(self, job: Job, start: int, values: tuple[TokenLogprobs, ...]) -> None:
        """A run's prompt logprobs, for the prompt tokens after positions ``start ..``: a run
        again over positions already scored (a recompute before its first token) replaces them."""
        if start > len(job.prompt_logprobs):
            raise ValueError(f"job {job.job_id}: prompt logprobs from position {start}, "
                             f"but only {len(job.prompt_logprobs)} positions before it are scored")
        job.prompt_logprobs[start: start + len(values)] = values

    def chunk_done(self, job: Job, end: int, served: Served, now: float) -> None:
        """Chunked prefill: a chunk that is not the first iteration's last completed. Its KV
        stays (positions up to ``end``); no token, no TTFT; its time is service in the level."""
        job.num_computed_tokens = end
        self.s.kv.commit(job.job_id, end, job.tokens)
        self._served(job, served, now)
        self.s.totals["prefill_chunks"] += 1
        # Skip-join placed the job where its whole first iteration fits the quantum; a chunk
        # boundary is not the end of it, so no demotion before its first token.
        self._idle_after_run(job, may_demote=False)

    def _idle_after_run(self, job: Job, may_demote: bool = True) -> None:
        job.state = JobState.RUNNABLE
        level = self.s.policy.demotion_level(job) if may_demote else None
        if level is not None:
            self._set_level(job, level)
            self._count(job, "demotions")
        self._place(job)

    def waste(self, job: Job, served: Served, now: float) -> None:
        """Naive MLFQ: the first iteration was cut at the quantum; its KV and token are lost,
        the time is spent, and the job moves down to start over."""
        self._served(job, served, now)
        self.s.kv.drop(job.job_id)
        self._to_waiting(job, "wasted_prefills", self.s.policy.level_after_quantum(job))

    def _served(self, job: Job, served: Served, now: float) -> None:
        job.stats.execution_s += served.wall_s - served.swap_wait_s
        job.stats.swap_blocked_s += served.swap_wait_s
        job.attained_s += served.share_s
        job.last_served = now
        job.starve_due = None
        job.idle_since = now

    def complete(self, step: int, seconds: float | None) -> tuple[InFlight, list[str]]:
        """Plan ``step`` returned after ``seconds`` (None: it ran no job, so it says nothing
        of a step's cost): its record, and the jobs whose swaps it settled."""
        if seconds is not None:
            w = self.s.config.step_time_ewma_weight
            prev = self.s.step_time_s
            self.s.step_time_s = seconds if prev is None else (1 - w) * prev + w * seconds
        return self.s.inflight.pop(step), self.s.kv.complete(step)

    def fail_step(self, step: int) -> InFlight:
        """Plan ``step`` failed: the jobs it was swapping lose their KV (unknown contents)."""
        rec = self.s.inflight.pop(step)
        self._lose_kv(self.s.kv.fail(step))
        return rec

    def void_inflight(self) -> None:
        """Every plan in flight is void (the data plane is gone for good): nothing they touch
        stays busy, and their jobs are idle again, so retiring them frees their KV at once."""
        s = self.s
        for step in list(s.inflight):
            s.inflight.pop(step)
            s.kv.fail(step)
        for job in s.jobs.values():
            if job.state is JobState.RUNNING:
                job.state = JobState.RUNNABLE

    def fail_job(self, job: Job, now: float) -> None:
        self._retire(job, JobState.FINISHED, "error", now)
        self.s.totals["errors"] += 1

    def settle(self, job_ids: list[str], now: float) -> None:
        """Swaps that completed: re-file the idle jobs they moved (now resident or on host). A
        job swapped in for its turn is pinned from here (not from the swap's issue: at PP >= 3
        the copy outlasts the pin) for ``swap_pin_plans`` decisions, and its wait for device
        space ends here: from now on it waits in the queue, not for a swap."""
        s = self.s
        for job_id in job_ids:
            idle = s.jobs.get(job_id)
            if idle is None or idle.state is not JobState.RUNNABLE:
                continue
            if s.kv.residency(job_id) is Residency.RESIDENT:
                if idle.pinned_until is not None:
                    idle.pinned_until = s.next_step + s.kv_config.swap_pin_plans - 1
                self._end_blocked(idle, now)
            self._place(idle)

    def _lose_kv(self, job_ids: list[str]) -> None:
        """A failed plan was swapping these jobs: their KV is gone, they will recompute."""
        for job_id in job_ids:
            job = self.s.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNABLE:
                self._to_waiting(job, "recomputes")

    def lose_all_kv(self, steps: list[int]) -> None:
        """The data plane was lost (its workers are being rebuilt): the in-flight ``steps`` did
        nothing and every job's KV is gone. Each job keeps the tokens it has and recomputes
        (prompt + generated) on the new workers; aborted jobs that waited for a step are let go."""
        s = self.s
        for step in steps:
            s.inflight.pop(step, None)
            s.kv.fail(step)   # settles the step: nothing it touched stays busy
        for job in list(s.jobs.values()):
            if job.state is JobState.ABORTED:
                self.forget_aborted(job)
            elif job.state in (JobState.RUNNABLE, JobState.RUNNING):
                s.kv.drop(job.job_id)
                self._to_waiting(job, "recomputes")
        s.kv.reset_prefix_cache()   # the workers' caches went with them

    def abort(self, job: Job, now: float) -> None:
        running = job.state is JobState.RUNNING
        if not running:
            job.stats.queueing_s += now - job.idle_since
        self._retire(job, JobState.ABORTED, "abort", now)
        if running:
            self.s.jobs[job.job_id] = job   # forgotten at the update of its plan
        self.s.totals["aborted"] += 1

    def forget_aborted(self, job: Job) -> None:
        del self.s.jobs[job.job_id]

    # ---- filing: a job's transitions, and its place in the candidate sets ---------------
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
