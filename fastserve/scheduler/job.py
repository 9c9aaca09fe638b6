"""Control-plane job state: ``JobRequest`` in, ``Job`` and its ``JobState`` and accounting, ``TokenDelta``s
(the last with its ``Finish``) out.

A job's progress is one number, ``Job.num_computed_tokens``, against its prompt + generated
tokens (vLLM's model): prefill, chunks, recompute and a naive-MLFQ cut are what that number, the
run's end and the policy say, not separate paths.

Only the scheduler mutates a ``Job`` (state, level, service); everything else reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastserve.worker.messages import FinishReason, SamplingParams, TokenLogprobs


class JobState(enum.Enum):
    WAITING = "waiting"      # no KV anywhere: never admitted, or its KV was dropped (recompute)
    RUNNABLE = "runnable"    # has KV (device or host), not in an in-flight plan
    RUNNING = "running"      # in an in-flight plan (stays in its queue, paper §4.3)
    FINISHED = "finished"
    ABORTED = "aborted"


ACTIVE_STATES = frozenset({JobState.WAITING, JobState.RUNNABLE, JobState.RUNNING})


@dataclass(frozen=True)
class Finish:
    """How a job ended: its reason and, from the scheduler, its accounting (none for a job ended
    outside it: an abort, a broken delivery)."""

    reason: FinishReason
    stats: JobStats | None = None


@dataclass(frozen=True)
class TokenDelta:
    """A job's output since its previous delta, from the scheduler to the HTTP layer.

    ``token_ids`` are the tokens since the previous delta: one per step out of the scheduler,
    several once a lagging reader's deltas are merged (``merge``); ``logprobs`` (only for a job
    that asked) has one entry per token and merges the same way. ``prompt_logprobs`` (only for a
    job that asked, on its first token's delta) has one entry per prompt token but the first.
    The job's last delta carries its ``finish`` (with or without tokens). ``emitted_at`` (wall
    clock, set where it leaves the engine replica) lets the reader measure the delivery delay.
    """

    job_id: str
    token_ids: tuple[int, ...] = ()
    finish: Finish | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    emitted_at: float = 0.0
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @classmethod
    def token(cls, job_id: str, token_id: int, finish: Finish | None = None,
              logprobs: TokenLogprobs | None = None,
              prompt_logprobs: tuple[TokenLogprobs, ...] | None = None) -> TokenDelta:
        return cls(job_id, (token_id,), finish, () if logprobs is None else (logprobs,),
                   prompt_logprobs=prompt_logprobs)

    @classmethod
    def ended(cls, job_id: str, reason: FinishReason, stats: JobStats | None = None) -> TokenDelta:
        """A last delta without tokens (an error, an abort)."""
        return cls(job_id, finish=Finish(reason, stats))

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish's reason; None while the job runs."""
        return None if self.finish is None else self.finish.reason

    @property
    def token_id(self) -> int | None:
        """The token of a one-step delta (None for a delta without a token)."""
        return self.token_ids[-1] if self.token_ids else None

    @classmethod
    def merge(cls, deltas: Sequence[TokenDelta]) -> TokenDelta:
        """Consecutive deltas of one job as one: every token, the last one's finish."""
        last = deltas[-1]
        if len(deltas) == 1:
            return last
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return replace(last, token_ids=tuple(t for d in deltas for t in d.token_ids),
                       logprobs=tuple(lp for d in deltas for lp in d.logprobs), prompt_logprobs=prompt)


@dataclass(frozen=True)
class JobRequest:
    """The one request type from the ingress to the scheduler: a tokenized request, validated
    once (``fastserve.errors.validate_request``) at the ingress; it becomes a ``Job`` on ``add``.
    ``arrival`` None = when the scheduler receives it."""

    job_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival: float | None = None
    #: Request priority (vLLM's field; lower = more urgent): shifts the MLFQ entry level by this
    #: many levels, clamped to the existing ones (the config refuses it for one-level policies).
    priority: int = 0
    #: Only jobs with the same salt share prefix-cache blocks (vLLM's ``cache_salt``).
    cache_salt: str | None = None


@dataclass
class JobStats:
    """Per-job accounting (paper Fig. 15b breakdown, plus ENST accuracy).

    ``queueing_s`` + ``swap_blocked_s`` + ``execution_s`` is the time from arrival to the last
    token. ``swap_blocked_s`` is time the job would have been picked but its KV was not on the
    device. ``enst_pairs`` holds (predicted ENST, actual wait until next scheduled) for every
    prediction made at a swap decision; ``enst_mae_s`` is their mean absolute error, reported in
    the response's ``job_stats`` and (per prediction) in the ``enst_error_seconds`` metric — how
    good ENST is, which the paper leaves open.
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
    #: The longest single wait for device space (from being wanted on the host to landing).
    longest_swap_blocked_s: float = 0.0
    demotions: int = 0
    promotions: int = 0
    swaps_in: int = 0
    swaps_out: int = 0
    recomputes: int = 0
    wasted_prefills: int = 0         # naive MLFQ: first iterations cut at the quantum, work lost
    #: Prompt positions its first iteration took from the prefix cache instead of computing.
    cached_tokens: int = 0
    enst_pairs: list[tuple[float, float]] = field(default_factory=list)
    #: Mean delay from the scheduler emitting an event to the ingress reading it (the ingress
    #: sets it on its copy of the finishing event's stats).
    delivery_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The per-job accounting a response carries (``job_stats``), in seconds and counts."""
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        e2e = None if self.finish_time is None else self.finish_time - self.arrival
        out: dict[str, Any] = {
            "queue_s": self.queueing_s, "exec_s": self.execution_s,
            "swap_blocked_s": self.swap_blocked_s,
            "longest_swap_blocked_s": self.longest_swap_blocked_s, "ttft_s": ttft, "e2e_s": e2e,
            "demotions": self.demotions, "promotions": self.promotions,
            "swaps_in": self.swaps_in, "swaps_out": self.swaps_out, "recomputes": self.recomputes,
            "num_generated": self.num_generated, "prompt_len": self.prompt_len,
            "cached_tokens": self.cached_tokens,
        }
        out["enst_mae_s"] = self.enst_mae_s
        out["enst_predictions"] = len(self.enst_pairs)
        if self.delivery_s is not None:
            out["delivery_s"] = self.delivery_s
        return out

    @property
    def enst_mae_s(self) -> float | None:
        """Mean |predicted ENST − actual wait until next scheduled|; None without predictions."""
        if not self.enst_pairs:
            return None
        return sum(abs(p - a) for p, a in self.enst_pairs) / len(self.enst_pairs)


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
    blocked_s: float = 0.0           # of its current idle spell, seconds blocked on a swap
    pinned_until: int | None = None  # swapped in for its turn: no swap-out victim up to this step
    promoted: bool = False           # promoted for starvation and not run since
    #: When it is promoted if still not served: set when its wait begins (from α for the backlog
    #: ahead of it then), None while it runs or is not watched for starvation.
    starve_due: float | None = None
    #: Its progress (vLLM's ``num_computed_tokens``): positions of ``tokens()`` whose KV exists,
    #: on the device or the host. 0 while it waits (never run, or its KV was dropped, lost or
    #: wasted); a cached prefix or each prefill chunk moves it on; a sampled token brings it to
    #: all but the newest position. Every run feeds ``tokens()[num_computed_tokens:end]``.
    num_computed_tokens: int = 0
    predictions: list[tuple[float, float]] = field(default_factory=list)  # (made at, ENST)
    #: Prompt positions the prefix cache held when it arrived (skip-join places it by the rest).
    cached_at_arrival: int = 0
    #: Prompt logprobs so far (``SamplingParams.prompt_logprobs``): entry ``p`` scores prompt
    #: token ``p + 1``; filled chunk by chunk, sent with its first token.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stats: JobStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = JobStats(self.job_id, self.arrival, len(self.prompt_ids))
        self.last_served = self.arrival
        self.idle_since = self.arrival

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def prompt_targets(self, start: int, end: int) -> tuple[int, ...]:
        """The prompt tokens a run over positions ``start .. end`` scores for its prompt
        logprobs: those its rows predict, while its first token is still to come (a recompute
        after it has nothing to send); empty unless its sampling asks."""
        if self.sampling.prompt_logprobs is None or self.generated:
            return ()
        return self.prompt_ids[start + 1: end + 1]

    @property
    def prefill_len(self) -> int:
        """Prompt positions its first iteration must compute: the uncached suffix."""
        return self.prompt_len - self.cached_at_arrival

    def tokens(self) -> tuple[int, ...]:
        """Its context: prompt and generated tokens."""
        return self.prompt_ids + tuple(self.generated)

    @property
    def num_generated(self) -> int:
        return len(self.generated)

    @property
    def num_tokens(self) -> int:
        """Its context's length, prompt + generated: where the run that samples its next token
        ends (a first iteration or recompute feeds all of them, a decode the newest one)."""
        return self.prompt_len + len(self.generated)

    @property
    def decoding(self) -> bool:
        """Its next run is a decode: one token, whose KV is all that is missing, after one it
        sampled. Otherwise the next run is (the rest of) a first iteration — a prompt, a
        recompute of prompt + generated, or what a cached prefix or earlier chunks left."""
        return bool(self.generated) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def prefilling(self) -> bool:
        """A first iteration is part-way: some of it computed (earlier chunks, or a prefix
        fetched from the host tier), its token not yet sampled."""
        return self.num_computed_tokens > 0 and not self.decoding

    @property
    def table_len(self) -> int:
        """Positions its block table covers once its last run completed: a first iteration's
        blocks are all taken with its first chunk; otherwise those computed."""
        return self.num_tokens if self.prefilling else self.num_computed_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.generated)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES
