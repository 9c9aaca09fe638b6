"""``SchedulerState``: everything a scheduler holds, and ``SchedulerView``, its read-only face.

``SchedulerState`` owns the data — jobs, level queues, in-flight plans, the KV manager, counters,
the measured step time — and no logic: ``fastserve.scheduler.apply.Applier`` is its only writer.
``SchedulerView`` is what the planners (batch, swaps) read: jobs, queue counts and candidate
walks, KV counts, the current α and ENST. Planners return decisions; they change nothing.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import count
from types import MappingProxyType
from typing import Protocol

from fastserve.kv.enst import EnstTable
from fastserve.kv.manager import KVCacheManager, Residency, Tier, Tokens
from fastserve.kv.prefix import PrefixHit
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig
from fastserve.scheduler.decision import Claim
from fastserve.scheduler.job import Job, JobStats
from fastserve.scheduler.policies import Policy, make_policy
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.queues import LevelQueues
from fastserve.scheduler.reserve import ArrivalReserve


@dataclass
class InFlight:
    scheduled_at: float
    job_ids: tuple[str, ...]
    wasted: frozenset[str]       # naive MLFQ: first iterations cut at the quantum (discarded)
    #: Chunked prefill: jobs running a chunk that is not their last -> where the chunk ends.
    chunks: dict[str, int] = field(default_factory=dict)


class KVView(Protocol):
    """The KV manager's queries (planners never allocate, swap or free)."""

    @property
    def num_free_device(self) -> int: ...
    @property
    def num_free_host(self) -> int: ...
    @property
    def device_releasing(self) -> int: ...
    def blocks_for(self, num_tokens: int) -> int: ...
    def tier(self, job_id: str) -> Tier: ...
    def residency(self, job_id: str) -> Residency: ...
    def num_blocks(self, job_id: str) -> int: ...
    def movable_blocks(self, job_id: str, keep: frozenset[int] = ...) -> int: ...
    def swap_in_blocks(self, job_id: str) -> int: ...
    def prefix_hit(self, job_id: str, num_tokens: int, tokens: Tokens) -> PrefixHit: ...
    def busy_step(self, job_id: str) -> int | None: ...
    def device_blocks_needed(self, job_id: str, num_tokens: int) -> int: ...


class SchedulerState:
    """The scheduler's data; written only by ``Applier``."""

    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig, profile: Profile,
                 eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.kv_config = kv_config
        self.profile = profile
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy: Policy = make_policy(config.policy, config, profile)
        self.kv = KVCacheManager(kv_config)
        self.queues = LevelQueues(self.policy.num_levels())
        self.quanta = self.policy.quanta()
        self.jobs: dict[str, Job] = {}
        self.inflight: dict[int, InFlight] = {}
        self.next_step = 0
        self.seq = count()
        self.level_seq = count()
        self.admit_seq = count()
        self.num_unadmitted = 0
        self.finished: deque[JobStats] = deque(maxlen=config.finished_stats_limit)
        self.reserve = ArrivalReserve(kv_config)
        self.totals: Counter[str] = Counter()
        self._decode_iteration = profile.t_dec(config.max_batch_size)
        #: Running mean of measured step durations (None until the first step returns).
        self.step_time_s: float | None = None
        #: Jobs waiting for device space the last decision wanted them for (``Job.blocked_since``).
        self.blocked: set[str] = set()
        #: Proactive preemption's claims (``decision.Claim``), as the last decision left them.
        self.claims: dict[str, Claim] = {}

    def alpha(self, level: int | None = None) -> float:
        """α for a job whose wait begins, or is checked, now in ``level`` (None: the lowest
        level, behind every job held): the configured one, but never under
        ``starvation_min_iterations`` decode iterations of the profile (paper: α is tuned to the
        SLO, and the SLO is 10 decode iterations) nor under ``starvation_backlog_batches``
        rounds of the backlog ahead of it — the jobs in its level and above, in batches of B,
        each round a measured step. A job already promoted waits longer
        (``Policy.starvation_wait``).

        The floor is in decode iterations, not measured steps: a step that carries first
        iterations is longer than a decode, and counting it made α grow with the prefill share
        of the work (a median 0.87 s instead of 0.3 s at prefill-heavy ratios)."""
        cfg = self.config
        ahead = len(self.jobs) if level is None else sum(self.queues.counts[:level])
        floor = cfg.starvation_min_iterations * self.decode_iteration()
        rounds = math.ceil(ahead / cfg.max_batch_size)
        backlog = cfg.starvation_backlog_batches * rounds * self.step_time_estimate()
        return max(cfg.starvation_alpha_s, floor, backlog)

    def decode_iteration(self) -> float:
        """α's unit: the profile's decode iteration at a full batch."""
        return self._decode_iteration

    def step_time_estimate(self) -> float:
        """The running mean of measured step times; before any step returned, the profile's
        decode at a full batch."""
        if self.step_time_s is not None:
            return self.step_time_s
        return self.profile.t_dec(self.config.max_batch_size)


class SchedulerView:
    """Read-only access for the planners."""

    def __init__(self, state: SchedulerState) -> None:
        self._s = state
        self.config = state.config
        self.kv_config = state.kv_config
        self.policy = state.policy
        self.profile = state.profile
        self.queues = state.queues     # planners walk candidate sets; every walk restores them
        self.kv: KVView = state.kv
        self.jobs: Mapping[str, Job] = MappingProxyType(state.jobs)

    @property
    def num_inflight(self) -> int:
        return len(self._s.inflight)

    def alpha(self) -> float:
        return self._s.alpha()

    def held_claims(self) -> dict[str, Claim]:
        """Claims still held: their plan is in flight (a plan completes after every earlier
        one, so the blocks they counted on are free or still being released) and their job is
        still here. Once the plan returned, the job takes free blocks in priority order."""
        s = self._s
        return {job_id: c for job_id, c in s.claims.items()
                if c.step in s.inflight and job_id in s.jobs}

    def enst_table(self, now: float) -> EnstTable | None:
        if not self.policy.uses_enst:
            return None
        return EnstTable(self.queues.counts, self._s.quanta, self.config.max_batch_size,
                         now, self.wall_per_service())

    def wall_per_service(self) -> float:
        """Wall seconds per second of service: one iteration gives each of its jobs q1 of
        service (``fastserve.scheduler.accounting``) and takes the measured step time (before any
        step returned, the profile's full-batch decode)."""
        return self._s.step_time_estimate() / self.profile.q1

    def reserve_blocks(self, now: float) -> int:
        return self._s.reserve.blocks(now)

    def pinned(self, job_id: str, step: int) -> bool:
        """Swapped in for its turn and not yet run, with the pin not yet expired."""
        until = self.jobs[job_id].pinned_until
        return until is not None and step <= until
