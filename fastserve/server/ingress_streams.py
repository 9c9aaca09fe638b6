"""Helpers for reading one job's stream at the ingress (``fastserve.server.ingress.OpenAIServer``).

``Replayed`` gives back a first item already read (the ingress waits for a job's first output
before answering); ``DeliveryDelay`` measures the mean delay from the scheduler emitting an
event to the ingress reading it (``job_stats.delivery_s``). Imports no ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastserve.engine.delivery import DeltaStream
from fastserve.scheduler.job import TokenDelta


class Replayed:
    """A stream whose first item was already read: yields it again, then the rest."""

    def __init__(self, first: TokenDelta, rest: DeltaStream) -> None:
        self._first: TokenDelta | None = first
        self._rest = rest

    def __aiter__(self) -> Replayed:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        return await self._rest.__anext__()

    def cancel(self) -> None:
        self._rest.cancel()


@dataclass
class DeliveryDelay:
    """Mean seconds from a scheduler emitting a stream item to the ingress reading it."""

    total: float = 0.0
    count: int = 0

    def observe(self, emitted_at: float) -> None:
        if emitted_at > 0:
            self.total += max(time.time() - emitted_at, 0.0)
            self.count += 1

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None
