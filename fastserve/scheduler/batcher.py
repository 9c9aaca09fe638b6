"""``BatchPlanner``: forms one batch (paper Algorithm 1, lines 22–25) against a local count of free
blocks; it allocates nothing, and ``Applier.apply`` takes the blocks.

Levels from the highest down, candidates in the policy's order, up to B jobs in the token budget;
at most B passed over, so a decision costs O(B log n). A job short of KV room takes it from idle
resident jobs it strictly outranks (``Policy.rank``), only when they cover the whole need — the
rules and why they cannot deadlock are in docs/scheduler.md, "Memory preemption by priority".
"""

from __future__ import annotations

from typing import Literal

from fastserve.kv.manager import Tier
from fastserve.scheduler.decision import BatchDecision, Claim, Evict, Fetch, Run
from fastserve.scheduler.job import Job
from fastserve.scheduler.state import SchedulerView


class BatchPlanner:
    def __init__(self, view: SchedulerView) -> None:
        self.view = view
        self.reactive = view.kv_config.swap_mode == "reactive"
        self.recompute = view.kv_config.swap_mode == "recompute"

    def plan(self, step: int, admit_new: bool = True) -> BatchDecision:
        """``admit_new=False`` keeps never-admitted jobs out (the blocks are for a stalled job)."""
        return _Walk(self, step, admit_new).run()


class _Walk:

    def __init__(self, planner: BatchPlanner, step: int, admit_new: bool) -> None:
        self.p = planner
        self.view = planner.view
        self.step = step
        self.admit_new = admit_new
        self.res = BatchDecision(free_device=self.view.kv.num_free_device,
                                 free_host=self.view.kv.num_free_host)
        cfg = self.view.config
        self.max_jobs = cfg.max_batch_size
        self.max_tokens = cfg.max_num_batched_tokens
        self.chunk_limit = cfg.chunk_limit()
        self.tokens = 0
        self.picked: set[str] = set()
        self.evicted: set[str] = set()
        #: The smallest need a victim scan of this walk could not cover (``_victims_below``).
        self.failed_short: int | None = None
        self._hold_claims()

    def _hold_claims(self) -> None:
        """Set aside held claims' blocks, from releasing blocks first; the rest of those is spare,
        taken before anyone is evicted."""
        res = self.res
        self.held = self.view.held_claims()
        res.claims = dict(self.held)
        reserved = sum(c.blocks for c in self.held.values())
        releasing = self.view.kv.device_releasing
        from_release = min(reserved, releasing)
        self.landed = min(reserved - from_release, res.free_device)   # claimed, already free
        res.free_device -= self.landed
        self.spare_release = releasing - from_release   # releasing, no claim holds them

    def full(self) -> bool:
        return len(self.picked) >= self.max_jobs or self.tokens >= self.max_tokens

    def run(self) -> BatchDecision:
        max_jobs = self.view.config.max_batch_size
        take_pending = True
        passed_over = 0
        first_waiting: str | None = None
        res = self.res
        # The walk reads the candidate sets and changes none: the Applier files the decision's jobs.
        for level in self.view.queues.levels:
            ready, pending = level.ready.ordered(), level.pending.ordered()
            r, p = next(ready, None), next(pending, None)
            while not self.full() and (r is not None or (take_pending and p is not None)):
                use_pending = take_pending and p is not None and (r is None or p[0] < r[0])
                if use_pending:
                    assert p is not None
                    job_id, p = p[1], next(pending, None)
                else:
                    assert r is not None
                    job_id, r = r[1], next(ready, None)
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
                    # As vLLM: no new job takes what a growth preemption freed.
                    no_memory = self._try_admit(job, admission_open=not res.waiting_needs and not self.evicted)
                    if no_memory and first_waiting is None:
                        first_waiting = job_id
                if len(self.picked) == before:
                    passed_over += 1
                    if passed_over >= max_jobs or self.view.policy.strict_admission:
                        take_pending = False
            if self.full():
                break
        if res.focus is None:
            res.focus = first_waiting
        res.unclaimed_release = self.spare_release
        return res

    def _fits_budget(self, n_tokens: int) -> bool:
        # A prompt over the whole budget may still run alone, or it never would.
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
        """Tokens a prefill chunk may feed now (the budget's rest, ≤ ``chunk_tokens``); None when off."""
        limit = self.chunk_limit
        if limit is None:
            return None
        return max(min(limit, self.max_tokens - self.tokens), 1)

    def _resident_end(self, job: Job) -> int:
        """From its computed tokens to its end, or a chunk of that which fits the budget."""
        end = job.num_tokens
        if self.chunk_limit is not None:
            room = self._chunk_room()
            assert room is not None
            end = min(end, job.num_computed_tokens + room)
        return end

    def _resident_run(self, job: Job, swap_in_first: bool = False) -> Run:
        return Run(job.job_id, job.num_computed_tokens, self._resident_end(job), swap_in_first=swap_in_first)

    def _try_resident(self, job: Job) -> None:
        end = self._resident_end(job)
        need = self.view.kv.device_blocks_needed(job.job_id, end)
        if need > self.res.free_device and self.view.policy.evicts_during_batch:
            self._preempt_latest(job)
        room = self._make_room(job, need)
        if room == "now":
            # A run is built only for a pick (the budget it reads has not moved since).
            self._pick(Run(job.job_id, job.num_computed_tokens, end), need)
        elif room is None:
            self.res.growth_needs[job.job_id] = need
            if self.res.focus is None:
                self.res.focus = job.job_id

    def _try_host(self, job: Job) -> None:
        run = self._resident_run(job, swap_in_first=True)
        if self.p.reactive:
            # The forward of this very plan waits for the copy.
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
        """Proactive: the swap plan brings this host job in; its blocks are set aside from lower picks."""
        self.res.wanted_host[job_id] = need
        self.res.free_device -= need
        if self.res.focus is None:
            self.res.focus = job_id

    def _try_admit(self, job: Job, admission_open: bool) -> bool:
        """Admit ``job`` if it fits; True when memory (or closed admission) kept it out. A device hit
        another table holds costs no block and is shared; a host hit costs a block in each tier."""
        kv = self.view.kv
        prefix = self.view.policy.preempted_prefix(job)
        n = job.num_tokens if prefix is None else prefix
        hit = kv.prefix_hit(job.job_id, n, job.tokens) if prefix is None else None
        start = 0 if hit is None else hit.tokens
        chunk = self._chunk_room()
        if chunk is not None and prefix is None:
            n = min(n, start + chunk)
        fetch = hit is not None and hit.num_host > 0 and not self.p.reactive
        if not fetch and not self._fits_budget(n - start):
            return False  # not a memory problem: it waits for a batch with room
        # The first chunk takes the whole first iteration's blocks (as vLLM).
        need = kv.blocks_for(n if prefix is not None else job.num_tokens)
        shared = hit.in_use if hit is not None and not self.evicted else ()
        need -= len(shared)
        # Before making room: no victim may count the shared hits as freed, or take the host blocks read.
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
        """``"now"``: free, or freed by drops / reactive swap-outs; ``"later"``: proactive swap-outs
        free it by the next decision (claimed); None: the jobs it outranks cannot cover it."""
        res = self.res
        self._renew_claim(job.job_id)
        short = need - res.free_device
        if short <= 0:
            return "now"
        if not self.view.policy.preempts_for_priority:
            return None
        deferred = not (self.p.recompute or self.p.reactive)
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
        res.claims[job.job_id] = Claim(need, self.step)
        res.free_device = 0
        return "later"

    def _renew_claim(self, job_id: str) -> None:
        """An earlier claim's blocks go back where ``_hold_claims`` took them, to claim again or run on."""
        claim = self.held.pop(job_id, None)
        if claim is None:
            return
        del self.res.claims[job_id]
        back = min(claim.blocks, self.landed)
        self.landed -= back
        self.res.free_device += back
        self.spare_release += claim.blocks - back

    def _victims_below(self, job: Job, short: int) -> list[tuple[str, int]] | None:
        """Idle resident jobs ranked below ``job``, lowest first, covering ``short``; else None. The
        scan stops at the first not outranked, skips at most B, and never retries a failed need."""
        if self.failed_short is not None and short >= self.failed_short:
            return None
        view = self.view
        policy, kv = view.policy, view.kv
        host_free = self.res.free_host
        keep = frozenset(self.res.shared_hits)    # shared blocks stay on the device
        chosen: list[tuple[str, int]] = []
        freed = skipped = 0
        for cand in view.queues.ordered("evictable", lowest_first=True):
            if freed >= short:
                break
            victim = view.jobs[cand]
            if not policy.outranks_for_memory(job, victim):
                break      # neither this one nor any after it ranks below ``job``
            if cand in self.picked or cand in self.evicted:
                continue
            on_host = 0 if self.p.recompute else kv.num_blocks(cand)
            if (kv.busy_step(cand) is not None or view.pinned(cand, self.step)
                    or (self.p.recompute and victim.prefilling) or on_host > host_free):
                # A part-done prefill is not dropped: two long prompts could drop each other forever.
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
        return _without_spare(chosen, freed - short)

    def _preempt_latest(self, job: Job) -> None:
        """vLLM: growth does not fit, so preempt the latest admitted idle job (dropped if the host is full)."""
        view, res = self.view, self.res
        victim = None
        for cand in view.queues.ordered("evictable"):
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


def _without_spare(chosen: list[tuple[str, int]], spare: int) -> list[tuple[str, int]]:
    """Victims the others already cover stay resident, the highest ranked first (they run soonest):
    each victim taken is one the scan would take anyway, so the claimant gets the same room."""
    kept = list(chosen)
    for i in range(len(kept) - 1, -1, -1):
        n = kept[i][1]
        if n <= spare:
            spare -= n
            del kept[i]
    return kept
