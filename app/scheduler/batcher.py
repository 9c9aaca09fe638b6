"""Batch formation for one decision (paper Algorithm 1, lines 22–25).

Walks the levels from the highest down and, within a level, candidates in the policy's order:
resident runnable jobs (``ready``) and jobs that need memory first (``pending``: not admitted,
recomputing, or on the host). It picks up to ``max_batch_size`` jobs within the token budget,
allocating device blocks as it goes (first iterations, recomputes, decode growth), and records
what it could not serve for lack of memory — the next iteration's known needs, which drive swap
planning. It passes over at most ``max_batch_size`` jobs that need memory or budget it does not
have, so a decision costs O(B log n), not O(queued jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from actors.messages import BatchEntry, SwapCommand
from app.kv.manager import KVCacheManager, Tier
from app.scheduler.config import KVCacheConfig, SchedulerConfig
from app.scheduler.job import Job
from app.scheduler.policies import Policy
from app.scheduler.prioset import Key, PrioritySet
from app.scheduler.queues import LevelQueues

#: Evict one idle resident job for this step: returns True when its blocks are free now (drop).
Evictor = Callable[[str, int], bool]


@dataclass
class BatchResult:
    entries: list[BatchEntry] = field(default_factory=list)
    selected: list[Job] = field(default_factory=list)
    admitted: list[Job] = field(default_factory=list)
    swap_in: list[SwapCommand] = field(default_factory=list)   # reactive: same-plan swap-ins
    waiting_needs: dict[str, int] = field(default_factory=dict)  # admission not possible
    growth_needs: dict[str, int] = field(default_factory=dict)   # decode growth not possible
    wanted_host: dict[str, int] = field(default_factory=dict)    # would run, KV on the host
    next_growth: int = 0          # blocks the selected jobs need for their next decode
    focus: str | None = None      # highest-priority job deferred for memory (stall breaker)

    @property
    def protected(self) -> set[str]:
        """The highest-priority job whose decode growth did not fit: never evicted for the
        others this step (lower-priority growth-blocked jobs may be, which frees room for it)."""
        return set(list(self.growth_needs)[:1])


class BatchBuilder:
    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig, policy: Policy,
                 queues: LevelQueues, kv: KVCacheManager, jobs: Mapping[str, Job],
                 evict: Evictor) -> None:
        self.config = config
        self.reactive = kv_config.swap_mode == "reactive"
        self.policy = policy
        self.queues = queues
        self.kv = kv
        self.jobs = jobs
        self.evict = evict
        self._tokens = 0   # tokens in the batch being built

    def build(self, step: int, admit_new: bool = True) -> BatchResult:
        """Form one batch. ``admit_new=False`` keeps jobs that never had KV out of it (their
        blocks are meant for a stalled admitted job)."""
        res = BatchResult()
        budget = self.config.max_num_batched_tokens
        max_jobs = self.config.max_batch_size
        self._tokens = 0
        popped: list[tuple[PrioritySet, Key, str]] = []
        take_pending = True
        passed_over = 0
        first_waiting: str | None = None
        for level in self.queues.levels:
            ready, pending = level.ready, level.pending
            while len(res.entries) < max_jobs and self._tokens < budget:
                r = ready.peek()
                p = pending.peek() if take_pending else None
                if r is None and p is None:
                    break
                use_pending = p is not None and (r is None or p[0] < r[0])
                source = pending if use_pending else ready
                top = source.pop()
                assert top is not None   # peeked above
                key, job_id = top
                popped.append((source, key, job_id))
                job = self.jobs[job_id]
                if not use_pending:
                    self._try_resident(job, step, res)
                    continue
                before = len(res.selected)
                if self.kv.tier(job_id) is Tier.HOST:
                    self._try_host(job, step, res)
                elif admit_new or job.admitted:
                    fits = self._try_admit(job, step, res, admission_open=not res.waiting_needs)
                    if not fits and first_waiting is None:
                        first_waiting = job_id
                if len(res.selected) == before:
                    # Passed over (memory or token budget): bound the walk to B such jobs, so
                    # a decision never scans the whole queue; FCFS stops at the first one.
                    passed_over += 1
                    if passed_over >= max_jobs or self.policy.strict_admission:
                        take_pending = False
            if len(res.entries) >= max_jobs or self._tokens >= budget:
                break
        chosen = {j.job_id for j in res.selected}
        for s, key, job_id in popped:
            if job_id not in chosen:
                s.add(job_id, key)
        if res.focus is None:
            res.focus = first_waiting
        return res

    # ---- one candidate each --------------------------------------------------------------
    def _fits_budget(self, n_tokens: int, res: BatchResult) -> bool:
        # A first iteration longer than the whole budget may still run alone, or never would.
        return not res.entries or self._tokens + n_tokens <= self.config.max_num_batched_tokens

    def _try_resident(self, job: Job, step: int, res: BatchResult) -> None:
        ctx = job.next_context_len
        need = self.kv.device_blocks_needed(job.job_id, ctx)
        if need > self.kv.num_free_device and self.policy.evicts_during_batch:
            self._preempt_latest(job, step, res)
        if need > self.kv.num_free_device:
            res.growth_needs[job.job_id] = need
            if res.focus is None:
                res.focus = job.job_id
            return
        self._select_decode(job, step, res)

    def _select_decode(self, job: Job, step: int, res: BatchResult) -> None:
        ctx = job.next_context_len
        table = self.kv.allocate(job.job_id, ctx, step)
        res.entries.append(BatchEntry(job.job_id, (job.generated[-1],), ctx - 1, table, False,
                                      job.sampling, len(job.generated)))
        res.selected.append(job)
        self._tokens += 1
        res.next_growth += self.kv.blocks_for(ctx + 1) - self.kv.blocks_for(ctx)

    def _try_host(self, job: Job, step: int, res: BatchResult) -> None:
        ctx = job.next_context_len
        need = self.kv.device_blocks_needed(job.job_id, ctx)
        if self.reactive and need <= self.kv.num_free_device:
            # Reactive: swap in with this very plan; the entry's forward waits for the copy.
            res.swap_in.append(self.kv.swap_in(job.job_id, step))
            self._select_decode(job, step, res)
            return
        res.wanted_host[job.job_id] = need
        if res.focus is None:
            res.focus = job.job_id

    def _try_admit(self, job: Job, step: int, res: BatchResult, admission_open: bool) -> bool:
        ctx = job.next_context_len
        if not self._fits_budget(ctx, res):
            return True  # not a memory problem: it simply waits for a batch with room
        need = self.kv.blocks_for(ctx)
        if not admission_open or need > self.kv.num_free_device:
            res.waiting_needs[job.job_id] = need
            return False
        tokens = job.prompt_ids + tuple(job.generated)
        table = self.kv.allocate(job.job_id, ctx, step)
        res.entries.append(BatchEntry(job.job_id, tokens, 0, table, True, job.sampling,
                                      len(job.generated)))
        res.selected.append(job)
        res.admitted.append(job)
        self._tokens += ctx
        res.next_growth += self.kv.blocks_for(ctx + 1) - self.kv.blocks_for(ctx)
        return True

    def _preempt_latest(self, job: Job, step: int, res: BatchResult) -> None:
        """vLLM-style: decode growth does not fit, so preempt the most recently admitted idle
        resident job (FCFS order makes it the lowest priority) — swapped out or dropped."""
        victim = None
        with self.queues.ordered("evictable", None) as order:
            for cand in order:
                if (cand != job.job_id and cand not in res.growth_needs
                        and self.kv.busy_step(cand) is None and not self.jobs[cand].pinned):
                    victim = cand
                    break
        if victim is not None:
            self.evict(victim, step)
