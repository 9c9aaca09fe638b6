"""Job state: ``JobRequest`` in; ``Job``, its ``JobState`` and ``JobStats``; ``TokenDelta``s out.
A job's progress is one number, ``num_computed_tokens`` (as vLLM's). Only the scheduler mutates a ``Job``."""

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
    """How a job ended; ``stats`` is None when it ended outside the scheduler."""

    reason: FinishReason
    stats: JobStats | None = None


@dataclass(frozen=True)
class TokenDelta:
    """A job's tokens since its previous delta (several once merged); the last carries ``finish``.
    ``logprobs`` (if asked) has one entry per token; ``prompt_logprobs`` (if asked, on the first
    token's delta) one per prompt token but the first."""

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
        return cls(job_id, finish=Finish(reason, stats))

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return None if self.finish is None else self.finish.reason

    @property
    def token_id(self) -> int | None:
        return self.token_ids[-1] if self.token_ids else None

    @classmethod
    def merge(cls, deltas: Sequence[TokenDelta]) -> TokenDelta:
        last = deltas[-1]
        if len(deltas) == 1:
            return last
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return replace(last, token_ids=tuple(t for d in deltas for t in d.token_ids),
                       logprobs=tuple(lp for d in deltas for lp in d.logprobs), prompt_logprobs=prompt)


@dataclass(frozen=True)
class JobRequest:
    """A tokenized request, validated at the ingress; ``arrival`` None: when the scheduler gets it."""

    job_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival: float | None = None
    priority: int = 0   # vLLM's (lower = sooner): shifts the MLFQ entry level, clamped
    cache_salt: str | None = None


@dataclass
class JobStats:
    """Per-job accounting (Fig. 15b): queueing + swap-blocked + execution = arrival to last token.
    ``enst_pairs``: (predicted ENST, actual wait) per swap decision."""

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
    longest_swap_blocked_s: float = 0.0
    demotions: int = 0
    promotions: int = 0
    swaps_in: int = 0
    swaps_out: int = 0
    recomputes: int = 0
    wasted_prefills: int = 0         # naive MLFQ: first iterations cut at the quantum
    cached_tokens: int = 0           # prompt positions taken from the prefix cache
    enst_pairs: list[tuple[float, float]] = field(default_factory=list)
    delivery_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
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
        if not self.enst_pairs:
            return None
        return sum(abs(p - a) for p, a in self.enst_pairs) / len(self.enst_pairs)


@dataclass(eq=False)
class Job:
    job_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival: float
    priority: int = 0
    seq: int = 0                     # arrival order (tie-breaks, FCFS)
    state: JobState = JobState.WAITING
    generated: list[int] = field(default_factory=list)
    level: int = 1                   # 1 = highest priority
    level_seq: int = 0               # FIFO order within its level
    attained_s: float = 0.0          # service attained in the current level
    last_served: float = 0.0         # starve clock origin: end of its last iteration (or arrival)
    admitted: bool = False
    admit_seq: int = -1
    idle_since: float = 0.0
    blocked_since: float | None = None   # when a decision first wanted it off the device
    blocked_s: float = 0.0           # of its current idle spell, seconds blocked on a swap
    pinned_until: int | None = None  # swapped in for its turn: no swap-out victim up to this step
    promoted: bool = False           # promoted for starvation and not run since
    #: Promotion time if still unserved, fixed when its wait begins; None while it runs.
    starve_due: float | None = None
    #: Positions of ``tokens()`` whose KV exists (device or host); 0 while waiting.
    num_computed_tokens: int = 0
    predictions: list[tuple[float, float]] = field(default_factory=list)  # (made at, ENST)
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
        return self.prompt_len - self.cached_at_arrival

    def tokens(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.generated)

    def tokens_between(self, start: int, end: int) -> tuple[int, ...]:
        """``tokens()[start:end]`` without building the whole sequence (a decode feeds one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return tuple(self.generated[start - n:end - n])
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + tuple(self.generated[:end - n])

    @property
    def num_generated(self) -> int:
        return len(self.generated)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def decoding(self) -> bool:
        """Its next run is a decode; otherwise (the rest of) a first iteration or recompute."""
        return bool(self.generated) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def prefilling(self) -> bool:
        """A first iteration is part-way (earlier chunks, or a fetched prefix)."""
        return self.num_computed_tokens > 0 and not self.decoding

    @property
    def table_len(self) -> int:
        """Positions its table covers: a first iteration's all are taken with its first chunk."""
        return self.num_tokens if self.prefilling else self.num_computed_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.generated)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES
