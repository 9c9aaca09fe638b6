"""A recording stand-in for ``ray.serve.metrics`` objects, so a recorder's output can be read back
without Ray (``fastserve.engine.metrics.Recorder(..., sink_factory=FakeSink)``)."""

from __future__ import annotations

import bisect
from typing import Any

from fastserve.engine.metrics import Family


class FakeSink:
    def __init__(self, family: Family, model_name: str) -> None:
        self.family, self.model_name = family, model_name
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        self.observed: list[float] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[tuple(sorted((tags or {}).items()))] = value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.observed.append(value)

    def bucket_counts(self) -> dict[float, int]:
        """Observations per bucket, keyed by the bucket's upper bound ``le`` (Prometheus: a value
        lands in the first bucket whose bound is >= it; ``inf`` for the overflow bucket)."""
        bounds = self.family.buckets
        out: dict[float, int] = {}
        for value in self.observed:
            i = bisect.bisect_left(bounds, value)
            le = bounds[i] if i < len(bounds) else float("inf")
            out[le] = out.get(le, 0) + 1
        return out


def sinks(recorder: Any) -> dict[str, FakeSink]:
    out: dict[str, FakeSink] = recorder._sinks
    return out
