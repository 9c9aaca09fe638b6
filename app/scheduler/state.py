"""``SchedulerState``: the scheduler's state and where each idle job is filed.

Owns the jobs (the only writer of ``Job.state``, level and service — together with its
subclasses ``MemoryPlanner`` and ``Scheduler``), the level queues, the in-flight plans, the
placement of idle jobs in the candidate sets, and the read-only views (stats, ENST, checks).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import count
from types import MappingProxyType
from typing import Any

from actors.messages import SwapCommand
from app.kv.enst import EnstTable
from app.kv.manager import KVCacheManager, Residency
from app.scheduler.checks import check_scheduler, scheduler_stats
from app.scheduler.config import KVCacheConfig, SchedulerConfig
from app.scheduler.job import Job, JobState, JobStats
from app.scheduler.policies import Policy, make_policy
from app.scheduler.profile import Profile
from app.scheduler.queues import LevelQueues


@dataclass
class InFlight:
    scheduled_at: float
    job_ids: tuple[str, ...]
    reactive: frozenset[str]     # jobs swapped in by this very plan (their forward waited)


class SchedulerState:
    """State shared by the decision (``Scheduler``) and swap (``MemoryPlanner``) halves."""

    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig, profile: Profile,
                 eos_token_id: int) -> None:
        self.config = config
        self.kv_config = kv_config
        self.profile = profile
        self.eos_token_id = eos_token_id
        self.policy: Policy = make_policy(config.policy, config, profile)
        self.kv = KVCacheManager(kv_config)
        self.queues = LevelQueues(self.policy.num_levels())
        self._quanta = self.policy.quanta()
        self._jobs: dict[str, Job] = {}
        self._inflight: dict[int, InFlight] = {}
        self._next_step = 0
        self._seq = count()
        self._level_seq = count()
        self._admit_seq = count()
        self._num_unadmitted = 0
        self._to_free: list[str] = []
        self._finished: deque[JobStats] = deque(maxlen=config.finished_stats_limit)
        self._arrivals: deque[tuple[float, int]] = deque()   # (time, prompt blocks)
        self._arrival_blocks = 0
        self.totals: Counter[str] = Counter()
        # Per decision: the swap commands the plan being built carries.
        self._step_out: list[SwapCommand] = []
        self._step_in: list[SwapCommand] = []
        self._dropped = False         # this decision dropped KV (blocks free at once)
        self._stall_dropped = False   # ... to unblock an admitted job (stall breaker)

    # ---- placement -----------------------------------------------------------------------
    def _set_level(self, job: Job, level: int) -> None:
        """Enter ``level`` at its back (FIFO by time of entering), with no service yet."""
        if job.level_seq:   # 0 until the job first joins a level (level_seq counts from 1)
            self.queues.leave(job.level)
        job.level = level
        job.level_seq = next(self._level_seq) + 1
        job.attained_s = 0.0
        self.queues.join(level)

    def _place(self, job: Job) -> None:
        """Put an idle job in the candidate sets its state and residency call for."""
        lv = self.queues.level(job.level)
        policy = self.policy
        if job.state is JobState.WAITING:
            lv.pending.add(job.job_id, policy.order_key(job))
        elif job.state is JobState.RUNNABLE:
            where = self.kv.residency(job.job_id)
            if where is Residency.RESIDENT:
                lv.ready.add(job.job_id, policy.order_key(job))
                lv.evictable.add(job.job_id, policy.victim_key(job))
            elif where is Residency.HOST:
                lv.pending.add(job.job_id, policy.order_key(job))
                lv.onhost.add(job.job_id, policy.prefetch_key(job))
        else:
            return
        if policy.starvation and job.level > 1:
            self.queues.starving.add(job.job_id, job.last_served)

    def _unplace(self, job: Job) -> None:
        self.queues.discard(job.level, job.job_id)

    def _count_swap(self, job: Job, what: str) -> None:
        setattr(job.stats, what, getattr(job.stats, what) + 1)
        self.totals[what] += 1

    def _enst_table(self, now: float) -> EnstTable | None:
        if not self.policy.uses_enst:
            return None
        return EnstTable(self.queues.counts, self._quanta, self.config.max_batch_size,
                         self.config.starvation_alpha_s, now)

    # ---- inspection ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._jobs) or bool(self._inflight)

    def num_waiting(self) -> int:
        """Jobs in the admission queue (never given KV)."""
        return self._num_unadmitted

    def num_inflight(self) -> int:
        return len(self._inflight)

    def jobs(self) -> Mapping[str, Job]:
        """Read-only view of the jobs the scheduler holds (for metrics and tests)."""
        return MappingProxyType(self._jobs)

    def enst(self, job_id: str, now: float) -> float | None:
        """ENST of a queued job at ``now`` (None for policies without levels' quanta)."""
        table = self._enst_table(now)
        job = self._jobs[job_id]
        return None if table is None else table(job.level, job.last_served)

    def drain_finished(self) -> list[JobStats]:
        """Accounting of jobs finished or aborted since the last call."""
        out = list(self._finished)
        self._finished.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return scheduler_stats(self)

    def check_invariants(self) -> None:
        """Raise AssertionError if scheduler or KV state is inconsistent (tests: every step)."""
        check_scheduler(self)
