"""Batch planning for one decision (paper Algorithm 1, lines 22–25): a pure planner.

Walks the levels from the highest down and, within a level, candidates in the policy's order:
resident runnable jobs (``ready``) and jobs that need memory first (``pending``: not admitted,
recomputing, or on the host). It picks up to ``max_batch_size`` jobs within the token budget
against a local count of free device blocks — it allocates nothing — and records what it could
not serve for lack of memory (the next iteration's known needs, which drive swap planning). It
passes over at most ``max_batch_size`` jobs that need memory or budget it does not have, so a
decision costs O(B log n), not O(queued jobs). The result is a ``BatchDecision``;
``Applier.apply`` takes the blocks.

**Memory preemption by priority** (DESIGN "Scheduling"; the paper's answer to its Strawman 1).
A job the walk reaches that lacks KV room — new, growing, or on the host — takes it from idle
resident jobs it strictly outranks (``Policy.rank``: for MLFQ a lower level; for one-level
policies later in their order), lowest priority first, also from jobs that would otherwise fit in this very
batch; never from a job of equal or higher rank, one in an in-flight plan, one already picked,
or one swapped in for its turn and not yet run. Victims are dropped under ``recompute`` (the
job runs in this plan), swapped out with their blocks reused by this plan under ``reactive``
(its forward stalls for the copy, as the paper's reactive baseline does), and swapped out one
plan ahead under ``proactive`` (the job claims the blocks and runs once the plan that carries
the swap-outs returned, with nothing stalled). Victims are taken only when they cover the whole
need, so every eviction buys its job an iteration. A claim (``decision.Claim``) is remembered
while that plan is in flight: with P plans in flight the next decisions come before the copy
lands, and each set its blocks aside instead of evicting again for the same job; blocks being
released that no claim holds (earlier plans' swap-outs, finished jobs) are taken before anyone
is evicted. Why two jobs cannot evict each other forever (the paper's deadlock):
``rank`` is a strict order at each decision, an eviction goes only down it, and it is followed
by the evicting job's iteration — a pair can swap places only after each made progress, and
only when demotion or promotion (α, bounded below by the backlog) reordered them.

With chunked prefill (``scheduler.chunked_prefill``) a first iteration's chunk feeds what is
left of the token budget, at most ``chunk_tokens``; a job whose earlier chunks ran is resident
(or swapped out) and its next run is its next chunk, not a decode. As in vLLM, the blocks of the
whole first iteration are taken with its first chunk, so a job part-way through its prompt never
waits for memory to go on: two such jobs cannot hold each other's blocks hostage.
"""

from __future__ import annotations

from typing import Literal

from fastserve.kv.manager import Tier
from fastserve.scheduler.decision import BatchDecision, Claim, Evict, Fetch, Run
from fastserve.scheduler.job import Job
from fastserve.scheduler.prioset import Key, PrioritySet
from fastserve.scheduler.state import SchedulerView


class BatchPlanner:
    def __init__(self, view: SchedulerView) -> None:
        self.view = view
        self.reactive = view.kv_config.swap_mode == "reactive"
        self.recompute = view.kv_config.swap_mode == "recompute"

    def plan(self, step: int, admit_new: bool = True) -> BatchDecision:
        """Form one batch. ``admit_new=False`` keeps jobs that never had KV out of it (their
        blocks are meant for a stalled admitted job)."""
        return _Walk(self, step, admit_new).run()


class _Walk:
    """One batch walk: its running totals live here, not on the planner."""

    def __init__(self, planner: BatchPlanner, step: int, admit_new: bool) -> None:
        self.p = planner
        self.view = planner.view
        self.step = step
        self.admit_new = admit_new
        self.res = BatchDecision(free_device=self.view.kv.num_free_device,
                                 free_host=self.view.kv.num_free_host)
        self.tokens = 0
        self.picked: set[str] = set()
        self.evicted: set[str] = set()
        #: The smallest need a victim scan of this walk could not cover (``_victims_below``).
        self.failed_short: int | None = None
        self._hold_claims()

    def _hold_claims(self) -> None:
        """Set aside the blocks of claims still held (``SchedulerView.held_claims``) before
        anything is planned: from the blocks in-flight steps release first, the rest (released
        since) from the free ones. What the claims leave of the releasing blocks is the walk's
        spare: a job short of room takes it before evicting anyone."""
        res = self.res
        self.held = self.view.held_claims()
        res.claims = dict(self.held)
        reserved = sum(c.blocks for c in self.held.values())
        releasing = self.view.kv.device_releasing
        from_release = min(reserved, releasing)
        #: Claimed blocks that have landed (set aside from ``free_device``).
        self.landed = min(reserved - from_release, res.free_device)
        res.free_device -= self.landed
        #: Blocks in-flight steps and this walk's swap-outs release that no claim holds.
        self.spare_release = releasing - from_release

    def full(self) -> bool:
        cfg = self.view.config
        return len(self.picked) >= cfg.max_batch_size or self.tokens >= cfg.max_num_batched_tokens

    def run(self) -> BatchDecision:
        popped: list[tuple[PrioritySet, Key, str]] = []
        try:
            return self._walk(popped)
        finally:    # the walk leaves the candidate sets as they were, even if it raised
            for s, key, job_id in popped:
                s.add(job_id, key)

    def _walk(self, popped: list[tuple[PrioritySet, Key, str]]) -> BatchDecision:
        max_jobs = self.view.config.max_batch_size
        take_pending = True
        passed_over = 0
        first_waiting: str | None = None
        res = self.res
        for level in self.view.queues.levels:
            ready, pending = level.ready, level.pending
            while not self.full():
                r = ready.peek()
                p = pending.peek() if take_pending else None
                if r is None and p is None:
                    break
                use_pending = p is not None and (r is None or p[0] < r[0])
                source = pending if use_pending else ready
                top = source.pop()      # restored by ``run``
                assert top is not None   # peeked above
                key, job_id = top
                popped.append((source, key, job_id))
                job = self.view.jobs[job_id]
                if job_id in self.evicted:
                    continue    # preempted for an earlier pick of this batch
                if not use_pending:
                    self._try_resident(job)
                    continue
                before = len(self.picked)
                if self.view.kv.tier(job_id) is Tier.HOST:
                    self._try_host(job)
                elif self.admit_new or job.admitted:
                    # As vLLM: a batch that preempted a job to let an older one grow admits no
                    # new job into what the preemption freed.
                    no_memory = self._try_admit(job, admission_open=not res.waiting_needs and not self.evicted)
                    if no_memory and first_waiting is None:
                        first_waiting = job_id
                if len(self.picked) == before:
                    # Passed over (memory or token budget): bound the walk to B such jobs, so
                    # a decision never scans the whole queue; FCFS stops at the first one.
                    passed_over += 1
                    if passed_over >= max_jobs or self.view.policy.strict_admission:
                        take_pending = False
            if self.full():
                break
        if res.focus is None:
            res.focus = first_waiting
        res.unclaimed_release = self.spare_release
        return res

    # ---- one candidate each --------------------------------------------------------------
    def _fits_budget(self, n_tokens: int) -> bool:
        # A first iteration longer than the whole budget may still run alone, or never would.
        budget = self.view.config.max_num_batched_tokens
        return not self.picked or self.tokens + n_tokens <= budget

    def _pick(self, run: Run, need: int) -> None:
        self.res.actions.append(run)
        self.picked.add(run.job_id)
        self.res.free_device -= need
        self.tokens += run.fed_tokens
        full = self.view.jobs[run.job_id].num_tokens
        if not run.wasted and run.end == full:   # a chunk's job grows only after its last
            kv = self.view.kv
            self.res.next_growth += kv.blocks_for(full + 1) - kv.blocks_for(full)

    def _chunk_room(self) -> int | None:
        """Chunked prefill: the tokens a chunk may feed now — what is left of the budget, at most
        ``chunk_tokens`` (>= 1 inside the walk, which stops at a full budget); None when off."""
        limit = self.view.config.chunk_limit()
        if limit is None:
            return None
        return max(min(limit, self.view.config.max_num_batched_tokens - self.tokens), 1)

    def _resident_run(self, job: Job, swap_in_first: bool = False) -> Run:
        """A job with KV runs from its computed tokens to its end: a decode, or the rest of a
        first iteration (chunked prefill, or a prefix fetched from the host tier) in a chunk
        that fits the budget's room."""
        end = job.num_tokens
        room = self._chunk_room()
        if room is not None:
            end = min(end, job.num_computed_tokens + room)
        return Run(job.job_id, job.num_computed_tokens, end, swap_in_first=swap_in_first)

    def _try_resident(self, job: Job) -> None:
        run = self._resident_run(job)
        need = self.view.kv.device_blocks_needed(job.job_id, run.end)
        if need > self.res.free_device and self.view.policy.evicts_during_batch:
            self._preempt_latest(job)
        room = self._make_room(job, need)
        if room == "now":
            self._pick(run, need)
        elif room is None:
            self.res.growth_needs[job.job_id] = need
            if self.res.focus is None:
                self.res.focus = job.job_id

    def _try_host(self, job: Job) -> None:
        run = self._resident_run(job, swap_in_first=True)
        if self.p.reactive:
            # Reactive: swap in with this very plan; the entry's forward waits for the copy.
            need = self.view.kv.device_blocks_needed(job.job_id, run.end)
            room = self._make_room(job, need)
            if room == "now":
                self._pick(run, need)
            elif room is None and self.res.focus is None:
                self.res.focus = job.job_id
            return
        need = self.view.kv.device_blocks_needed(job.job_id, job.num_tokens)
        room = self._make_room(job, need)
        if room == "now":
            self._want(job.job_id, need)
        elif room is None and self.res.focus is None:
            self.res.focus = job.job_id

    def _want(self, job_id: str, need: int) -> None:
        """Proactive: the swap plan brings this host job in now (it runs at the next decision);
        its blocks are set aside so that lower-priority picks of this walk cannot take them."""
        self.res.wanted_host[job_id] = need
        self.res.free_device -= need
        if self.res.focus is None:
            self.res.focus = job_id

    def _try_admit(self, job: Job, admission_open: bool) -> bool:
        """Admit ``job`` into the batch if it fits; True when memory (or closed admission) kept
        it out, False when it was picked or only the token budget was short.

        Prefix caching: it computes only what the cache lacks, from ``start``. A device hit
        that some table already holds costs no block (unless this walk evicted a holder: then
        every hit is counted), and is marked shared so that no eviction counts it as freed; a
        host hit costs a device block, and a host block until its copy lands. A prefix with host
        hits is fetched with this plan and the job runs once it landed (``Fetch``), except under
        ``reactive``, where its forward waits for the copy in this very plan (as a reactive
        swap-in does). (A first
        iteration naive MLFQ cuts at the quantum ignores the cache.)"""
        kv = self.view.kv
        prefix = self.view.policy.preempted_prefix(job)
        n = job.num_tokens if prefix is None else prefix
        hit = kv.prefix_hit(job.job_id, n, job.tokens) if prefix is None else None
        start = 0 if hit is None else hit.tokens
        chunk = self._chunk_room()
        if chunk is not None and prefix is None:
            n = min(n, start + chunk)   # chunked prefill: the first chunk
        fetch = hit is not None and hit.num_host > 0 and not self.p.reactive
        if not fetch and not self._fits_budget(n - start):
            return False  # not a memory problem: it simply waits for a batch with room
        # A first iteration in chunks takes the blocks of all of it with its first chunk.
        need = kv.blocks_for(n if prefix is not None else job.num_tokens)
        shared = hit.in_use if hit is not None and not self.evicted else ()
        need -= len(shared)
        # (Set aside before making room: no victim found for it may count its shared hits as
        # freed, or swap into the host blocks its fetch reads.)
        self.res.shared_hits.update(shared)
        host_reads = 0 if hit is None else hit.host_unreferenced
        self.res.free_host -= host_reads
        room = self._make_room(job, need) if admission_open else None
        if room != "now":
            self.res.free_host += host_reads
        if room == "later":
            return False    # runs at the next decision, in the blocks it claimed
        if room is None:
            self.res.waiting_needs[job.job_id] = need
            return True
        if fetch:
            assert hit is not None
            self.res.actions.append(Fetch(job.job_id, hit.num_host))
            self.res.free_device -= need
            return False
        self._pick(Run(job.job_id, start, n, wasted=prefix is not None,
                       host_hits=0 if hit is None else hit.num_host), need)
        return False

    def _make_room(self, job: Job, need: int) -> Literal["now", "later"] | None:
        """Device room for ``need`` blocks of ``job``: ``"now"`` when free (or freed at once by
        drops, or by swap-outs this plan stalls for under reactive), ``"later"`` when proactive
        swap-outs free it for the next decision (claimed here), None when the jobs it outranks
        cannot cover it (nothing is evicted then)."""
        res = self.res
        self._renew_claim(job.job_id)
        short = need - res.free_device
        if short <= 0:
            return "now"
        if not self.view.policy.preempts_for_priority:
            return None
        deferred = not (self.p.recompute or self.p.reactive)
        # Proactive: blocks being released that no claim holds (this walk's swap-outs, earlier
        # plans' swap-outs and finished jobs, the job's own claim of an earlier decision).
        spare = self.spare_release if deferred else 0
        if short > spare:
            victims = self._victims_below(job, short - spare)
            if victims is None:
                return None
            for victim, _n in victims:
                self.evicted.add(victim)
                res.actions.append(Evict(victim, drop=self.p.recompute,
                                         reuse_now=self.p.reactive, for_job=job.job_id))
                if not self.p.recompute:
                    res.free_host -= self.view.kv.num_blocks(victim)
            freed = sum(n for _, n in victims)
            if not deferred:
                res.free_device += freed
                return "now"
            self.spare_release += freed
        self.spare_release -= short
        # The job takes every free block and ``short`` of the released, held until the plan of
        # this decision returns (``Claim``).
        res.claims[job.job_id] = Claim(need, self.step)
        res.free_device = 0
        return "later"

    def _renew_claim(self, job_id: str) -> None:
        """The walk reached a job holding a claim of an earlier decision: its blocks go back
        where ``_hold_claims`` took them from (landed ones first), for this decision to claim
        again or run on."""
        claim = self.held.pop(job_id, None)
        if claim is None:
            return
        del self.res.claims[job_id]
        back = min(claim.blocks, self.landed)
        self.landed -= back
        self.res.free_device += back
        self.spare_release += claim.blocks - back

    def _victims_below(self, job: Job, short: int) -> list[tuple[str, int]] | None:
        """Idle resident jobs strictly below ``job`` in rank, lowest priority first, whose blocks
        cover ``short``; None when they cannot (then none is taken).

        Bounded: candidates come in non-increasing rank (levels from the lowest priority up;
        within a level every MLFQ job has the same rank, and a one-level policy's swap-out order
        is its order reversed), so the scan stops at the first one ``job`` does not outrank; it
        passes over at most B candidates it may not take (in a plan, pinned, or too large for
        the host) besides this batch's own picks and victims. And the walk reaches jobs in
        non-decreasing rank while picks, evictions and host blocks only shrink what a later job
        may take, so once a need could not be covered no later need as large is scanned for."""
        if self.failed_short is not None and short >= self.failed_short:
            return None
        view = self.view
        policy, kv = view.policy, view.kv
        host_free = self.res.free_host
        keep = frozenset(self.res.shared_hits)    # shared blocks stay on the device
        chosen: list[tuple[str, int]] = []
        freed = skipped = 0
        with view.queues.ordered("evictable", lambda level, _job: -float(level)) as order:
            for cand in order:
                if freed >= short:
                    break
                victim = view.jobs[cand]
                if not policy.outranks_for_memory(job, victim):
                    break      # neither this one nor any after it ranks below ``job``
                if cand in self.picked or cand in self.evicted:
                    continue
                on_host = 0 if self.p.recompute else kv.num_blocks(cand)   # at most its table
                if (kv.busy_step(cand) is not None or view.pinned(cand, self.step)
                        or (self.p.recompute and victim.prefilling) or on_host > host_free):
                    # (A first iteration part-way through its chunks is not dropped: two long
                    # prompts could otherwise drop each other's chunks forever.)
                    skipped += 1
                    if skipped > view.config.max_batch_size:
                        break
                    continue
                host_free -= on_host
                n = kv.movable_blocks(cand, keep)
                chosen.append((cand, n))
                freed += n
        if freed < short:
            self.failed_short = short
            return None
        return chosen

    def _preempt_latest(self, job: Job) -> None:
        """vLLM-style: decode growth does not fit, so preempt the most recently admitted idle
        resident job (FCFS order makes it the lowest priority) — swapped out, or dropped in
        recompute mode or when the host has no room (then its blocks are free at once)."""
        view, res = self.view, self.res
        victim = None
        with view.queues.ordered("evictable", None) as order:
            for cand in order:
                if (cand != job.job_id and cand not in res.growth_needs
                        and cand not in self.picked and cand not in self.evicted
                        and view.kv.busy_step(cand) is None
                        and not view.pinned(cand, self.step)):
                    victim = cand
                    break
        if victim is None:
            return
        n = view.kv.movable_blocks(victim, frozenset(res.shared_hits))
        on_host = view.kv.num_blocks(victim)
        drop = self.p.recompute or on_host > res.free_host
        self.evicted.add(victim)
        res.actions.append(Evict(victim, drop))
        if drop:
            res.free_device += n
        else:
            res.free_host -= on_host
            self.spare_release += n     # released when this plan returns
