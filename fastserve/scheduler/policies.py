"""Scheduling policies: how a job is ranked, where it enters, whether it is demoted or promoted.

A policy is a small set of rules over a ``Job``; the mechanism (queues, batches, swaps) is the
``Scheduler``'s and is shared, so every policy is compared on the same machinery (paper §5).

* ``skip_join_mlfq`` — the paper's scheduler (§4.1, Algorithm 1): levels with quanta
  q1 = one decode iteration (the profile's smallest, t_dec(1)), q(i+1) = growth·q(i); a job
  joins the highest level whose quantum covers its first iteration; demoted η levels once the
  service it attained in its level exceeds the quantum (service is its own work, charged in
  ``fastserve.scheduler.accounting``: a decode is one decode iteration, so a job in level i gets
  ~2^(i−1) tokens however full its batches are); promoted to level 1 after α.
* ``naive_mlfq`` — classic MLFQ: every job joins level 1; a first iteration longer than the
  level's quantum is preempted at the quantum and its work lost (paper Figure 7(b)), unless
  ``naive_preempts_first_iteration`` is off (then it runs to completion and is demoted after).
  With chunked prefill nothing is cut: the chunk boundaries are the preemption points, and a
  job that spent its quantum on chunks is demoted between them, keeping their KV.
* ``fixed_priority`` — by input length (shorter first), no demotion, no promotion.
* ``fcfs`` — vLLM-style run to completion: arrival order, admission stops at the first job that
  does not fit, never preempts for priority; when decode growth does not fit it preempts the most
  recently admitted job.
* ``srpt_oracle`` — shortest remaining processing time, knowing the output length
  (``max_tokens``, meaningful with ``ignore_eos``); experiments only.
"""

from __future__ import annotations

from collections.abc import Callable

from fastserve.scheduler.config import PolicyName, SchedulerConfig
from fastserve.scheduler.job import Job
from fastserve.scheduler.prioset import Key
from fastserve.scheduler.profile import Profile


class Policy:
    name: PolicyName
    demotes = False               # MLFQ demotion when the quantum is exhausted
    starvation = False            # promotion to level 1 after α without service
    uses_enst = False             # swap order across levels by ENST (else: policy order)
    strict_admission = False      # stop admitting at the first job that does not fit
    evicts_for_admission = True   # may swap out / drop idle jobs to admit waiting ones
    evicts_during_batch = False   # preempts the latest admitted job when growth does not fit
    #: A job the batch wants that lacks KV room takes it from jobs it strictly outranks
    #: (``rank``): swapped out, or dropped under recompute (DESIGN "Scheduling").
    preempts_for_priority = True

    def __init__(self, config: SchedulerConfig, profile: Profile) -> None:
        self.config = config
        self.profile = profile

    def num_levels(self) -> int:
        return 1

    def quanta(self) -> list[float]:
        """Quantum of every level (ENST input); single-level policies have no quantum."""
        return [0.0] * self.num_levels()

    def entry_level(self, job: Job) -> int:
        return 1

    def order_key(self, job: Job) -> Key:
        """Batch order within a level (smaller first; ties in insertion order)."""
        raise NotImplementedError

    def victim_key(self, job: Job) -> Key:
        """Swap-out order within a level (smaller first): the lowest priority first."""
        return -self.order_key(job)

    def rank(self, job: Job) -> tuple[int, Key]:
        """Priority as a strict order at one decision (smaller = more urgent): level first, then
        the order within it. Memory preemption takes KV only from a strictly larger rank."""
        return job.level, self.order_key(job)

    def outranks_for_memory(self, job: Job, victim: Job) -> bool:
        """Whether ``job`` may take ``victim``'s KV (memory preemption): a strictly larger rank."""
        return self.rank(job) < self.rank(victim)

    def prefetch_key(self, job: Job) -> Key:
        """Swap-in order within a level (smaller first)."""
        return self.order_key(job)

    def demotion_level(self, job: Job) -> int | None:
        """The level a job moves to after an iteration, or None to stay (no demotion)."""
        return None

    def level_after_quantum(self, job: Job) -> int:
        """Where a job goes once its quantum is spent (single-level policies: where it is)."""
        return job.level

    def may_be_promoted(self, job: Job) -> bool:
        """Whether an idle job's starve clock is watched (it is promoted once past α)."""
        return False

    def promotion_level(self, job: Job) -> int | None:
        """The level a job past its promotion time moves to, or None (no promotion)."""
        return None

    def starvation_wait(self, promotions: int, alpha_s: float) -> float:
        """How long a job that was promoted ``promotions`` times may wait unserved before it is
        promoted again: α, times the backoff for each (``SchedulerConfig.starvation_backoff``)."""
        return alpha_s * self.config.starvation_backoff ** promotions

    def preempted_prefix(self, job: Job) -> int | None:
        """Prompt tokens a first iteration gets through before its quantum preempts it (the
        work is then lost), or None when it runs whole."""
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
        """Skip-join: min i with q_i ≥ t_init(prompt_len), the lowest level if none is — of the
        prompt it must compute, which a cached prefix shortens (``Job.prefill_len``)."""
        t_init = self.profile.t_init(job.prefill_len)
        for i, q in enumerate(self._quanta, start=1):
            if q >= t_init:
                return i
        return len(self._quanta)

    def order_key(self, job: Job) -> Key:
        return job.level_seq

    def rank(self, job: Job) -> tuple[int, Key]:
        """By level alone: memory preemption goes only across levels. Within a level the order
        is FIFO by entering it, which every demotion reshuffles; taking KV on that order would
        swap two jobs of one level back and forth at each demotion."""
        return job.level, 0.0

    def outranks_for_memory(self, job: Job, victim: Job) -> bool:
        return victim.level - job.level >= self.config.preemption_level_gap

    def victim_key(self, job: Job) -> Key:
        # Within a level ENST = min(α − starve, wait(level)) is largest for the job served most
        # recently, and smallest for the one served longest ago.
        return -job.last_served

    def prefetch_key(self, job: Job) -> Key:
        return job.last_served

    def demotion_level(self, job: Job) -> int | None:
        """η levels down once the service attained in the level exceeds its quantum. Service is
        a sum of q1-multiples, so the compare allows for its rounding: k decodes of q1 each
        never count as more than k·q1."""
        quantum = self.quantum(job.level)
        if job.attained_s > quantum * (1 + _SERVICE_RTOL) and job.level < len(self._quanta):
            return self.level_after_quantum(job)
        return None

    def level_after_quantum(self, job: Job) -> int:
        return min(job.level + self.config.demotion_eta, len(self._quanta))

    def may_be_promoted(self, job: Job) -> bool:
        return job.level > 1

    def promotion_level(self, job: Job) -> int | None:
        """Starvation prevention: level 1 once not served for longer than its α."""
        return 1 if job.level > 1 else None


class NaiveMLFQ(SkipJoinMLFQ):
    name: PolicyName = "naive_mlfq"

    def entry_level(self, job: Job) -> int:
        return 1

    def preempted_prefix(self, job: Job) -> int | None:
        """Classic MLFQ enforces the quantum on the first iteration too: one that would take
        longer than what is left of it is cut at the quantum (the lowest level has no cut)."""
        if not self.config.naive_preempts_first_iteration or job.generated or job.prompt_len < 2:
            return None   # (a one-token prompt has no prefix to stop at)
        if self.config.chunked_prefill.enabled:
            return None   # chunks already stop at their boundaries, losing nothing
        if job.level >= self.num_levels():
            return None
        left = self.quantum(job.level) - job.attained_s
        if self.profile.t_init(job.prompt_len) <= left:
            return None
        return self.profile.longest_prompt_within(left, job.prompt_len - 1)

    def may_be_promoted(self, job: Job) -> bool:
        """No boost for a job still working through a first iteration that is being cut: in
        level 1 it would only be cut again, and a job that keeps being promoted before its
        descent reaches a quantum long enough would never produce a token. (With chunked prefill
        nothing is cut, so such a job is watched like any other.)"""
        cuts = self.config.naive_preempts_first_iteration and not self.config.chunked_prefill.enabled
        if cuts and not job.generated:
            return False
        return super().may_be_promoted(job)


#: Arrival order fits in the low bits of a fixed-priority key (2**40 jobs is never reached).
_SEQ_BITS = 40


class FixedPriority(Policy):
    name: PolicyName = "fixed_priority"

    def order_key(self, job: Job) -> Key:
        # (prompt length, arrival) packed in one integer: shorter first, then earlier.
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
    name: PolicyName = "srpt_oracle"

    def remaining_s(self, job: Job) -> float:
        """Remaining processing time if the job generates exactly ``max_tokens`` tokens."""
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
