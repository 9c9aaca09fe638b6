"""Control-plane job state: ``Job``, its lifecycle ``JobState``, its accounting and ``TokenDelta``.

Only the scheduler mutates a ``Job`` (state, level, service); everything else reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from actors.messages import FinishReason, SamplingParams


class JobState(enum.Enum):
    WAITING = "waiting"      # no KV anywhere: never admitted, or its KV was dropped (recompute)
    RUNNABLE = "runnable"    # has KV (device or host), not in an in-flight plan
    RUNNING = "running"      # in an in-flight plan (stays in its queue, paper §4.3)
    FINISHED = "finished"
    ABORTED = "aborted"


ACTIVE_STATES = frozenset({JobState.WAITING, JobState.RUNNABLE, JobState.RUNNING})


@dataclass(frozen=True)
class TokenDelta:
    """One event of a job's stream: a new token, and whether the job is done (and why).

    ``token_id`` is None for an event without a token (abort, or a failed step).
    """

    job_id: str
    token_id: int | None
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class JobRequest:
    """What a caller hands the scheduler; it becomes a ``Job`` on ``add``."""

    job_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival: float | None = None
    #: Request priority (vLLM's field; lower = more urgent): shifts the MLFQ entry level by this
    #: many levels, clamped to the existing ones. Single-level policies ignore it.
    priority: int = 0


@dataclass
class JobStats:
    """Per-job accounting (paper Fig. 15b breakdown, plus ENST accuracy).

    ``queueing_s`` + ``swap_blocked_s`` + ``execution_s`` is the time from arrival to the last
    token. ``swap_blocked_s`` is time the job would have been picked but its KV was not on the
    device. ``enst_pairs`` holds (predicted ENST, actual wait until next scheduled) for every
    prediction made at a swap decision.
    """

    job_id: str
    arrival: float
    prompt_len: int
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    num_generated: int = 0
    queueing_s: float = 0.0
    execution_s: float = 0.0
    swap_blocked_s: float = 0.0
    demotions: int = 0
    promotions: int = 0
    swaps_in: int = 0
    swaps_out: int = 0
    recomputes: int = 0
    wasted_prefills: int = 0         # naive MLFQ: first iterations cut at the quantum, work lost
    enst_pairs: list[tuple[float, float]] = field(default_factory=list)


@dataclass(eq=False)
class Job:
    """A request inside the scheduler."""

    job_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival: float
    priority: int = 0                # see JobRequest.priority
    seq: int = 0                     # arrival order (tie-breaks, FCFS)
    state: JobState = JobState.WAITING
    generated: list[int] = field(default_factory=list)
    level: int = 1                   # 1 = highest priority
    level_seq: int = 0               # order of entering the current level (FIFO within a level)
    attained_s: float = 0.0          # service attained in the current level
    last_served: float = 0.0         # starve clock origin: end of its last iteration (or arrival)
    admitted: bool = False           # ever given KV (leaves the admission queue)
    admit_seq: int = -1              # admission order (FCFS preempts the latest admitted)
    idle_since: float = 0.0          # when it last stopped running (queueing time accounting)
    blocked_since: float | None = None   # first decision it was passed over for not being resident
    pinned_until: int | None = None  # swapped in for its turn: no swap-out victim up to this step
    promoted: bool = False           # promoted for starvation and not run since
    #: Chunked prefill: positions of the first iteration in progress whose KV earlier chunks
    #: computed (0 when none is in progress, and whenever the job's KV is dropped).
    prefilled: int = 0
    predictions: list[tuple[float, float]] = field(default_factory=list)  # (made at, ENST)
    stats: JobStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = JobStats(self.job_id, self.arrival, len(self.prompt_ids))
        self.last_served = self.arrival
        self.idle_since = self.arrival

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.generated)

    @property
    def next_context_len(self) -> int:
        """Positions the next iteration's entry covers: prompt + generated so far.

        A first iteration (or recompute) feeds all of them; a decode feeds the last generated
        token at position ``prompt + generated - 1``. Either way the entry ends here.
        """
        return self.prompt_len + len(self.generated)

    @property
    def kv_len(self) -> int:
        """Positions the job's KV table covers once its last iteration completed: those whose
        KV exists, or all of a first iteration part-way through its chunks (its blocks are taken
        with the first chunk)."""
        if self.prefilled:
            return self.next_context_len
        return self.next_context_len - 1 if self.generated else 0

    @property
    def mid_prefill(self) -> bool:
        """Chunked prefill: earlier chunks of its first iteration ran, the last has not."""
        return self.prefilled > 0

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.generated)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES
