"""What planners return and ``Applier.apply`` runs: one ``Decision`` (runs, evictions, swaps) per ``schedule``."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastserve.kv.enst import EnstTable
from fastserve.kv.swap_planner import SwapDecision


@dataclass(frozen=True)
class Run:
    """One batch entry: the job's tokens ``start .. end``; it samples when ``end`` is ``num_tokens``."""

    job_id: str
    start: int
    end: int
    swap_in_first: bool = False   # reactive: the KV comes back with this plan (the forward waits)
    wasted: bool = False          # naive MLFQ's cut first iteration: token and KV discarded
    host_hits: int = 0            # reactive: cached-prefix blocks copied in from the host

    @property
    def fed_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Evict:
    """An idle resident job leaves the device for a higher-priority one, or for FCFS's growth."""

    job_id: str
    drop: bool
    reuse_now: bool = False   # reactive: this plan reuses its blocks, the forward waits for the copy
    for_job: str | None = None


@dataclass(frozen=True)
class Fetch:
    """Admit a job whose cached prefix is partly on the host; it runs once the copy landed."""

    job_id: str
    host_hits: int     # blocks the walk found only on the host (no more are fetched)


@dataclass(frozen=True)
class Claim:
    """Blocks set aside for a job while its plan is in flight: no later decision evicts again for it."""

    blocks: int
    step: int      # the plan of the decision that made (or last renewed) it


@dataclass
class BatchDecision:
    actions: list[Run | Evict | Fetch] = field(default_factory=list)
    waiting_needs: dict[str, int] = field(default_factory=dict)
    growth_needs: dict[str, int] = field(default_factory=dict)
    wanted_host: dict[str, int] = field(default_factory=dict)    # would run, KV on the host
    next_growth: int = 0          # blocks the selected jobs need for their next decode
    focus: str | None = None      # highest-priority job deferred for memory (stall breaker)
    free_device: int = 0          # device blocks free once the runs (and claims) have theirs
    free_host: int = 0            # host blocks free once evictions have theirs
    unclaimed_release: int = 0    # blocks being released that no claim holds
    claims: dict[str, Claim] = field(default_factory=dict)
    #: Cached blocks admitted jobs share with a holder: evicting the holder leaves them.
    shared_hits: set[int] = field(default_factory=set)

    @property
    def runs(self) -> list[Run]:
        return [a for a in self.actions if isinstance(a, Run)]

    @property
    def protected(self) -> set[str]:
        """Claimants, and the highest-priority job whose growth did not fit."""
        return set(self.claims) | set(list(self.growth_needs)[:1])


@dataclass
class Decision:
    step: int
    batch: BatchDecision
    swaps: SwapDecision = field(default_factory=SwapDecision)
    unstick: SwapDecision = field(default_factory=SwapDecision)
    table: EnstTable | None = None

    @property
    def dropped(self) -> bool:
        return bool(self.swaps.drop or self.unstick.drop
                    or any(isinstance(a, Evict) and a.drop for a in self.batch.actions))
