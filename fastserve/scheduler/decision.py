"""The values planners return and ``Applier.apply`` runs: one ``Decision`` per ``schedule``.

A decision says what the next plan does — which jobs run and how (``Run``), which idle jobs are
evicted for them, which KV is swapped or dropped — with the block counts it was planned against.
Nothing here touches jobs or blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastserve.kv.enst import EnstTable
from fastserve.kv.swap_planner import SwapDecision


@dataclass(frozen=True)
class Run:
    """One entry of the next batch: the job's tokens ``start .. end`` (``Job.tokens()``).

    ``start`` is the job's ``num_computed_tokens`` (for a job admitted now, what the prefix
    cache holds). The run samples a token when it reaches the job's ``num_tokens`` (a decode,
    a whole first iteration or its last chunk) and not when it stops short (a prefill chunk);
    a run the policy cuts short (``wasted``) samples a token that is discarded with its KV.
    """

    job_id: str
    start: int
    end: int
    #: Reactive mode: the job's KV comes back with this very plan (its forward waits).
    swap_in_first: bool = False
    #: Naive MLFQ: a first iteration cut at the quantum; its token and KV are discarded.
    wasted: bool = False
    #: Prefix caching (reactive): blocks of its cached prefix the walk found only on the host,
    #: copied in with this plan (its forward waits); no more are taken at apply time.
    host_hits: int = 0

    @property
    def fed_tokens(self) -> int:
        """Tokens the entry feeds (its share of the token budget)."""
        return self.end - self.start


@dataclass(frozen=True)
class Evict:
    """An idle resident job leaves the device for a job the batch wants: a strictly
    higher-priority one (memory preemption by priority), or FCFS's decode growth."""

    job_id: str
    drop: bool          # dropped (blocks free at once) rather than swapped out
    #: Swapped out with its blocks reused by this very plan (reactive: the forward stalls for
    #: the copy); otherwise they are free once the plan completes.
    reuse_now: bool = False
    #: The job whose KV room it was evicted for (memory preemption by priority); None for
    #: FCFS's decode growth.
    for_job: str | None = None


@dataclass(frozen=True)
class Fetch:
    """Prefix caching (not under ``reactive``): a new job whose cached prefix is (partly) on the host is
    admitted with this plan — its table taken, the host blocks copied back — and runs once the
    copy landed, from the first position the cache did not hold (as a prefill chunk would)."""

    job_id: str
    host_hits: int     # blocks the walk found only on the host (no more are fetched)


@dataclass(frozen=True)
class Claim:
    """Proactive preemption: device blocks a job set aside for its next run — free ones and
    ones that swap-outs in flight release — held while the plan of the decision that made it
    is in flight, so that no later decision takes them or evicts again for the job."""

    blocks: int
    step: int      # the plan of the decision that made (or last renewed) it


@dataclass
class BatchDecision:
    #: Runs, fetches and evictions in the order they were decided (the order ``apply`` takes
    #: blocks).
    actions: list[Run | Evict | Fetch] = field(default_factory=list)
    waiting_needs: dict[str, int] = field(default_factory=dict)  # admission not possible
    growth_needs: dict[str, int] = field(default_factory=dict)   # decode growth not possible
    wanted_host: dict[str, int] = field(default_factory=dict)    # would run, KV on the host
    next_growth: int = 0          # blocks the selected jobs need for their next decode
    focus: str | None = None      # highest-priority job deferred for memory (stall breaker)
    free_device: int = 0          # device blocks free once the runs (and claims) have theirs
    free_host: int = 0            # host blocks free once evictions have theirs
    #: Device blocks in-flight steps and this plan's swap-outs release that no claim holds:
    #: what the swap plan may count on being free by the next decision.
    unclaimed_release: int = 0
    #: Every claim after this decision (``Claim``): those it made or renewed, and those of
    #: earlier decisions whose job it did not reach. No swap plan evicts a claimant.
    claims: dict[str, Claim] = field(default_factory=dict)
    #: Device blocks that jobs admitted by this decision take as their cached prefix while
    #: another job holds them: an eviction of that job leaves them (they become shared).
    shared_hits: set[int] = field(default_factory=set)

    @property
    def runs(self) -> list[Run]:
        return [a for a in self.actions if isinstance(a, Run)]

    @property
    def protected(self) -> set[str]:
        """Jobs the swap plan must not evict: those holding a claim, and the highest-priority
        job whose decode growth did not fit (lower-priority growth-blocked jobs may be evicted,
        which frees room for it)."""
        return set(self.claims) | set(list(self.growth_needs)[:1])


@dataclass
class Decision:
    step: int
    batch: BatchDecision
    swaps: SwapDecision = field(default_factory=SwapDecision)
    #: Stall breaker: nothing runs or is in flight; room made for ``batch.focus``.
    unstick: SwapDecision = field(default_factory=SwapDecision)
    table: EnstTable | None = None

    @property
    def dropped(self) -> bool:
        return bool(self.swaps.drop or self.unstick.drop
                    or any(isinstance(a, Evict) and a.drop for a in self.batch.actions))
