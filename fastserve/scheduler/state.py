"""``SchedulerState``, all a scheduler holds (``Applier`` its only writer); ``SchedulerView``, its read-only face."""

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
    wasted: frozenset[str]       # naive MLFQ: cut first iterations
    chunks: dict[str, int] = field(default_factory=dict)


class KVView(Protocol):
    """The KV manager's queries."""

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
        #: α's two fixed floors, read at every placement and promotion check.
        self._alpha_floor = max(config.starvation_alpha_s,
                                config.starvation_min_iterations * self._decode_iteration)
        self.step_time_s: float | None = None   # running mean of measured steps
        self.blocked: set[str] = set()          # wanted off the device (``Job.blocked_since``)
        self.claims: dict[str, Claim] = {}

    def alpha(self, level: int | None = None) -> float:
        """α for a wait beginning now in ``level`` (None: behind every job): the configured one,
        floored at decode iterations of the profile (not measured steps, which carry prefills)
        and at rounds of the backlog ahead."""
        cfg = self.config
        ahead = len(self.jobs) if level is None else sum(self.queues.counts[:level])
        rounds = math.ceil(ahead / cfg.max_batch_size)
        backlog = cfg.starvation_backlog_batches * rounds * self.step_time_estimate()
        return max(self._alpha_floor, backlog)

    def decode_iteration(self) -> float:
        return self._decode_iteration

    def step_time_estimate(self) -> float:
        if self.step_time_s is not None:
            return self.step_time_s
        return self.profile.t_dec(self.config.max_batch_size)


class SchedulerView:
    def __init__(self, state: SchedulerState) -> None:
        self._s = state
        self.config = state.config
        self.kv_config = state.kv_config
        self.policy = state.policy
        self.profile = state.profile
        self.queues = state.queues     # planners walk the candidate sets; only the Applier changes them
        self.kv: KVView = state.kv
        self.jobs: Mapping[str, Job] = MappingProxyType(state.jobs)

    @property
    def num_inflight(self) -> int:
        return len(self._s.inflight)

    def alpha(self) -> float:
        return self._s.alpha()

    def held_claims(self) -> dict[str, Claim]:
        """Claims whose plan is still in flight and whose job is still here."""
        s = self._s
        return {job_id: c for job_id, c in s.claims.items()
                if c.step in s.inflight and job_id in s.jobs}

    def enst_table(self, now: float) -> EnstTable | None:
        if not self.policy.uses_enst:
            return None
        return EnstTable(self.queues.counts, self._s.quanta, self.config.max_batch_size,
                         now, self.wall_per_service())

    def wall_per_service(self) -> float:
        """Wall seconds per second of service: an iteration gives each job q1 and takes a step."""
        return self._s.step_time_estimate() / self.profile.q1

    def reserve_blocks(self, now: float) -> int:
        return self._s.reserve.blocks(now)

    def pinned(self, job_id: str, step: int) -> bool:
        until = self.jobs[job_id].pinned_until
        return until is not None and step <= until
