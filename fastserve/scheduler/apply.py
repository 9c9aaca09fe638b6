"""``Applier``: the only writer of job and KV-manager state.

Runs what the planners decided (``apply``) and what an executor reported (``advance``, ``waste``,
``settle``, ...) through a few named job transitions, and keeps every idle job filed in the
candidate sets its state and residency call for (``_place``).
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

    share_s: float        # its service (``fastserve.scheduler.accounting``)
    wall_s: float         # the step's duration
    swap_wait_s: float    # of which the forward waited for swaps


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
        """The backlog ahead grew since the wait began: promotion moves to ``due`` (never earlier)."""
        assert job.starve_due is not None and due > job.starve_due
        job.starve_due = due
        self.s.queues.starving.add(job.job_id, due)
        self.s.totals["promotions_postponed"] += 1

    def apply(self, decision: Decision, now: float, out: Applied) -> None:
        """Actions in decided order, then swaps, then the stall breaker, into ``out``."""
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
        """Blocked while a batch wants it off the device; unwanted, with no copy under way, it queues."""
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
        # A cut run takes only what it feeds (its KV is dropped after).
        whole = run.end if run.wasted else job.num_tokens
        if not run.wasted and s.kv.tier(job.job_id) is Tier.NONE:
            cached, fetch = s.kv.admit(job.job_id, whole, step, job.tokens, runs=True,
                                       max_host=run.host_hits)
            if cached < run.start:
                # An earlier action took a cached block the walk counted as a hit: compute
                # from what is still cached, as many tokens as planned.
                run = replace(run, start=cached, end=min(cached + run.fed_tokens, whole))
            if fetch is not None:   # host hits: the forward waits for the copy
                out.swap_in.append(fetch)
            self._note_prefix(job, whole, cached)
            job.num_computed_tokens = cached
            table = s.kv.block_table(job.job_id)
        else:
            table = s.kv.allocate(job.job_id, whole, step)
        samples = run.wasted or run.end == job.num_tokens
        context = (job.sampling.context(job.prompt_ids, job.generated, s.eos_token_ids)
                   if samples else None)
        out.entries.append(BatchEntry(job.job_id, job.tokens_between(run.start, run.end), run.start,
                                      table, not job.decoding, job.sampling,
                                      len(job.generated), samples, context,
                                      prompt_targets=job.prompt_targets(run.start, run.end)))
        if not samples:
            out.chunks[job.job_id] = run.end
        if run.wasted:
            out.wasted.add(job.job_id)
        self._start(job, now)

    def _fetch(self, job: Job, host_hits: int, step: int, now: float, out: Applied) -> None:
        """Admit a job whose cached prefix is partly on the host; it runs once the copy landed."""
        s = self.s
        whole = job.num_tokens
        if not s.kv.prefix_hit(job.job_id, whole, job.tokens, host_hits).tokens:
            # An earlier action evicted the cached blocks: admitted as new at a later decision.
            return
        cached, fetch = s.kv.admit(job.job_id, whole, step, job.tokens, runs=False,
                                   max_host=host_hits)
        if fetch is not None:
            out.swap_in.append(fetch)
        self._note_prefix(job, whole, cached)
        self._unplace(job)
        self._admit(job)
        job.state = JobState.RUNNABLE
        job.num_computed_tokens = cached
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
        for job_id in decision.drop:   # first: a swap-in may be planned into their blocks
            self._drop(job_id, table)
        for job_id in decision.swap_in:
            job = self._predict(job_id, table)
            self._unplace(job)
            out.swap_in.append(self.s.kv.swap_in(job_id, step))
            job.pinned_until = step + self.s.kv_config.swap_pin_plans
            self._count(job, "swaps_in")
            self._place(job)   # in transit: only the starvation clock keeps running
        for job_id in decision.swap_out:
            self._swap_out(job_id, step, table, out, reuse_now=False)

    def _evict(self, action: Evict, step: int, table: EnstTable | None, out: Applied) -> None:
        self.s.totals["preemptions"] += 1
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
        job = self.s.jobs[job_id]
        if table is not None:
            job.predictions.append((table.now, table(job.level, job.starve_due)))
        return job

    def advance(self, job: Job, token: int, served: Served, now: float) -> FinishReason | None:
        job.num_computed_tokens = job.num_tokens
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
        """A prefill chunk short of the last completed: KV kept, no token, its time is service."""
        job.num_computed_tokens = end
        self.s.kv.commit(job.job_id, end, job.tokens)
        self._served(job, served, now)
        self.s.totals["prefill_chunks"] += 1
        # Skip-join placed it by the whole first iteration: no demotion before its first token.
        self._idle_after_run(job, may_demote=False)

    def _idle_after_run(self, job: Job, may_demote: bool = True) -> None:
        job.state = JobState.RUNNABLE
        level = self.s.policy.demotion_level(job) if may_demote else None
        if level is not None:
            self._set_level(job, level)
            self._count(job, "demotions")
        self._place(job)

    def waste(self, job: Job, served: Served, now: float) -> None:
        """Naive MLFQ's cut first iteration: KV and token lost, the job moves down to start over."""
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
        """Plan ``step`` returned after ``seconds`` (None: it ran no job); its record and settled jobs."""
        if seconds is not None:
            w = self.s.config.step_time_ewma_weight
            prev = self.s.step_time_s
            self.s.step_time_s = seconds if prev is None else (1 - w) * prev + w * seconds
        return self.s.inflight.pop(step), self.s.kv.complete(step)

    def fail_step(self, step: int) -> InFlight:
        rec = self.s.inflight.pop(step)
        self._lose_kv(self.s.kv.fail(step))
        return rec

    def void_inflight(self) -> None:
        """The data plane is gone for good: plans in flight are void, their jobs idle again."""
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
        """Re-file the idle jobs completed swaps moved. A swap-in's pin counts from here, not from
        its issue: at PP >= 3 the copy outlasts the pin."""
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
        for job_id in job_ids:
            job = self.s.jobs.get(job_id)
            if job is not None and job.state is JobState.RUNNABLE:
                self._to_waiting(job, "recomputes")

    def lose_all_kv(self, steps: list[int]) -> None:
        """The workers are being rebuilt: ``steps`` did nothing; every job keeps its tokens and recomputes."""
        s = self.s
        for step in steps:
            s.inflight.pop(step, None)
            s.kv.fail(step)
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

    def _set_level(self, job: Job, level: int) -> None:
        if job.level_seq:   # 0 until the job first joins a level (level_seq counts from 1)
            self.s.queues.leave(job.level)
        job.level = level
        job.level_seq = next(self.s.level_seq) + 1
        job.attained_s = 0.0
        self.s.queues.join(level)

    def _place(self, job: Job) -> None:
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
                # α is fixed when the wait begins: a backlog that drains later does not shorten it.
                wait = policy.starvation_wait(job.stats.promotions, s.alpha(job.level))
                job.starve_due = job.last_served + wait
            s.queues.starving.add(job.job_id, job.starve_due)

    def _unplace(self, job: Job) -> None:
        self.s.queues.discard(job.level, job.job_id)

    def _count(self, job: Job, what: str) -> None:
        setattr(job.stats, what, getattr(job.stats, what) + 1)
        self.s.totals[what] += 1

    def _to_waiting(self, job: Job, counted_as: str, level: int | None = None) -> None:
        """Its KV is gone: it waits to recompute prompt + generated, in ``level`` if it moves."""
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
