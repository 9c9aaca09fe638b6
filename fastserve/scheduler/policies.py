"""Scheduling policies: how a job is ranked, where it enters, whether it is demoted or promoted.
The mechanism (queues, batches, swaps) is shared, so policies compare on one machinery (paper §5);
each policy is described in docs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Callable

from fastserve.scheduler.config import PolicyName, SchedulerConfig
from fastserve.scheduler.job import Job
from fastserve.scheduler.prioset import Key
from fastserve.scheduler.profile import Profile


class Policy:
    name: PolicyName
    demotes = False
    starvation = False
    uses_enst = False             # swap order across levels by ENST (else: policy order)
    strict_admission = False      # stop admitting at the first job that does not fit
    evicts_for_admission = True
    evicts_during_batch = False   # preempts the latest admitted job when growth does not fit
    preempts_for_priority = True  # takes KV room from jobs it strictly outranks

    def __init__(self, config: SchedulerConfig, profile: Profile) -> None:
        self.config = config
        self.profile = profile

    def num_levels(self) -> int:
        return 1

    def quanta(self) -> list[float]:
        return [0.0] * self.num_levels()

    def entry_level(self, job: Job) -> int:
        return 1

    def order_key(self, job: Job) -> Key:
        """Batch order within a level (smaller first)."""
        raise NotImplementedError

    def victim_key(self, job: Job) -> Key:
        return -self.order_key(job)

    def rank(self, job: Job) -> tuple[int, Key]:
        """A strict order at one decision (smaller = more urgent)."""
        return job.level, self.order_key(job)

    def outranks_for_memory(self, job: Job, victim: Job) -> bool:
        return self.rank(job) < self.rank(victim)

    def prefetch_key(self, job: Job) -> Key:
        return self.order_key(job)

    def demotion_level(self, job: Job) -> int | None:
        return None

    def level_after_quantum(self, job: Job) -> int:
        return job.level

    def may_be_promoted(self, job: Job) -> bool:
        return False

    def promotion_level(self, job: Job) -> int | None:
        return None

    def starvation_wait(self, promotions: int, alpha_s: float) -> float:
        return alpha_s * self.config.starvation_backoff ** promotions

    def preempted_prefix(self, job: Job) -> int | None:
        """Prompt tokens a first iteration gets through before the quantum cuts it; None: runs whole."""
        return None


#: Relative slack when comparing attained service with a quantum (float sums of q1).
_SERVICE_RTOL = 1e-9


class SkipJoinMLFQ(Policy):
    name: PolicyName = "skip_join_mlfq"
    demotes = True
    starvation = True
    uses_enst = True

    def __init__(self, config: SchedulerConfig, profile: Profile) -> None:
        super().__init__(config, profile)
        q1 = profile.q1
        n = config.num_levels or profile.num_levels(config.quantum_growth, q1)
        self._quanta = [q1 * config.quantum_growth**i for i in range(n)]

    def num_levels(self) -> int:
        return len(self._quanta)

    def quanta(self) -> list[float]:
        return list(self._quanta)

    def quantum(self, level: int) -> float:
        return self._quanta[level - 1]

    def entry_level(self, job: Job) -> int:
        """Skip-join: min i with q_i ≥ t_init of the uncached prompt, else the lowest level."""
        t_init = self.profile.t_init(job.prefill_len)
        for i, q in enumerate(self._quanta, start=1):
            if q >= t_init:
                return i
        return len(self._quanta)

    def order_key(self, job: Job) -> Key:
        return job.level_seq

    def rank(self, job: Job) -> tuple[int, Key]:
        """By level alone: the FIFO order inside a level is reshuffled by every demotion, and
        preempting on it would swap two jobs of one level back and forth."""
        return job.level, 0.0

    def outranks_for_memory(self, job: Job, victim: Job) -> bool:
        return victim.level - job.level >= self.config.preemption_level_gap

    def victim_key(self, job: Job) -> Key:
        # Within a level ENST is largest for the job served most recently.
        return -job.last_served

    def prefetch_key(self, job: Job) -> Key:
        return job.last_served

    def demotion_level(self, job: Job) -> int | None:
        """η levels down once service exceeds the quantum; k decodes never count as more than k·q1."""
        quantum = self.quantum(job.level)
        if job.attained_s > quantum * (1 + _SERVICE_RTOL) and job.level < len(self._quanta):
            return self.level_after_quantum(job)
        return None

    def level_after_quantum(self, job: Job) -> int:
        return min(job.level + self.config.demotion_eta, len(self._quanta))

    def may_be_promoted(self, job: Job) -> bool:
        return job.level > 1

    def promotion_level(self, job: Job) -> int | None:
        return 1 if job.level > 1 else None


class NaiveMLFQ(SkipJoinMLFQ):
    name: PolicyName = "naive_mlfq"

    def entry_level(self, job: Job) -> int:
        return 1

    def preempted_prefix(self, job: Job) -> int | None:
        """Classic MLFQ cuts a first iteration at the quantum too (not in the lowest level)."""
        if not self.config.naive_preempts_first_iteration or job.generated or job.prompt_len < 2:
            return None   # a one-token prompt has no prefix to stop at
        if self.config.chunked_prefill.enabled:
            return None   # chunk boundaries are the preemption points
        if job.level >= self.num_levels():
            return None
        left = self.quantum(job.level) - job.attained_s
        if self.profile.t_init(job.prompt_len) <= left:
            return None
        return self.profile.longest_prompt_within(left, job.prompt_len - 1)

    def may_be_promoted(self, job: Job) -> bool:
        """Not while its first iteration is cut: in level 1 it would be cut again, never reaching a token."""
        cuts = self.config.naive_preempts_first_iteration and not self.config.chunked_prefill.enabled
        if cuts and not job.generated:
            return False
        return super().may_be_promoted(job)


#: Arrival order in the low bits of a fixed-priority key.
_SEQ_BITS = 40


class FixedPriority(Policy):
    """Shorter prompt first, then earlier; no demotion or promotion."""

    name: PolicyName = "fixed_priority"

    def order_key(self, job: Job) -> Key:
        return (job.prompt_len << _SEQ_BITS) | job.seq


class FCFS(Policy):
    name: PolicyName = "fcfs"
    strict_admission = True
    evicts_for_admission = False
    evicts_during_batch = True
    preempts_for_priority = False   # run to completion: only growth preempts (vLLM)

    def order_key(self, job: Job) -> Key:
        return job.seq

    def victim_key(self, job: Job) -> Key:
        return -job.admit_seq


class SRPTOracle(Policy):
    """Shortest remaining time, knowing the output length; experiments only."""

    name: PolicyName = "srpt_oracle"

    def remaining_s(self, job: Job) -> float:
        decode = self.profile.t_dec(1)
        if not job.generated:
            return self.profile.t_init(job.prompt_len) + (job.sampling.max_tokens - 1) * decode
        return job.remaining_tokens * decode

    def order_key(self, job: Job) -> Key:
        return self.remaining_s(job)


_REGISTRY: dict[PolicyName, Callable[[SchedulerConfig, Profile], Policy]] = {
    "skip_join_mlfq": SkipJoinMLFQ,
    "naive_mlfq": NaiveMLFQ,
    "fixed_priority": FixedPriority,
    "fcfs": FCFS,
    "srpt_oracle": SRPTOracle,
}


def make_policy(name: PolicyName, config: SchedulerConfig, profile: Profile) -> Policy:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(_REGISTRY)}") from None
    return factory(config, profile)
