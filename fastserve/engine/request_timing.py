"""Per-request timestamps the engine loop sees, turned into vLLM v1's request and token metrics
(``RequestStateStats``, ``IterationStats``) in the engine's clock: prompt and generation tokens per
step, TTFT and inter-token gaps as they happen, and e2e/queue/prefill/decode/inference intervals
of completed jobs. Definitions: docs/operations.md. Imports no torch, no ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fastserve.scheduler.job import TokenDelta

#: Finish reasons that get latency and length histograms (an abort or error has no meaningful latency).
COMPLETED = ("stop", "length")


@dataclass
class _Timeline:
    arrival: float
    prompt_len: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0


@dataclass(frozen=True)
class FinishedTiming:
    """One completed request's intervals (seconds) and lengths (tokens)."""

    job_id: str
    finish_reason: str
    prompt_len: int
    num_generated: int
    e2e_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    inference_s: float
    #: decode_s / (num_generated - 1); None for a one-token answer (vLLM records 0 there; we skip it).
    time_per_output_token_s: float | None


@dataclass
class TimingBatch:
    """What happened since the last ``drain``."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[FinishedTiming] = field(default_factory=list)


class RequestTimer:
    """The engine loop's per-request clock; ``drain`` hands over what accumulated."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Timeline] = {}
        self._batch = TimingBatch()

    def __len__(self) -> int:
        return len(self._jobs)

    def added(self, job_id: str, arrival: float, prompt_len: int) -> None:
        self._jobs[job_id] = _Timeline(arrival, prompt_len)

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def scheduled(self, job_ids: Iterable[str], now: float) -> None:
        """The first plan that includes a job ends its queueing."""
        for job_id in job_ids:
            t = self._jobs.get(job_id)
            if t is not None and t.scheduled is None:
                t.scheduled = now

    def step(self, deltas: Sequence[TokenDelta], now: float) -> None:
        batch = self._batch
        for delta in deltas:
            t = self._jobs.get(delta.job_id)
            if t is None:
                continue
            n = len(delta.token_ids)
            if n:
                batch.generation_tokens += n
                if t.first_token is None:
                    t.first_token = now
                    batch.prompt_tokens += t.prompt_len
                    batch.ttfts.append(now - t.arrival)
                else:
                    assert t.last_token is not None
                    batch.itls.append(now - t.last_token)
                t.last_token = now
                t.generated += n
            if delta.finish_reason is not None:
                del self._jobs[delta.job_id]
                if delta.finish_reason in COMPLETED and t.first_token is not None:
                    batch.finished.append(_finished(delta.job_id, delta.finish_reason, t, now))

    def drain(self) -> TimingBatch:
        out, self._batch = self._batch, TimingBatch()
        return out


def _finished(job_id: str, reason: str, t: _Timeline, now: float) -> FinishedTiming:
    assert t.first_token is not None and t.last_token is not None
    scheduled = t.first_token if t.scheduled is None else t.scheduled
    decode = t.last_token - t.first_token
    return FinishedTiming(
        job_id, reason, t.prompt_len, t.generated, e2e_s=now - t.arrival,
        queue_s=scheduled - t.arrival, prefill_s=t.first_token - scheduled, decode_s=decode,
        inference_s=t.last_token - scheduled,
        time_per_output_token_s=decode / (t.generated - 1) if t.generated > 1 else None)
