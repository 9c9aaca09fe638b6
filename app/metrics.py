"""Prometheus metrics: per-replica recording, cross-replica aggregation, text rendering.

Owns the metric names and the exposition format served at ``GET /metrics``:

* ``Histogram``: cumulative-bucket histograms (TTFT, time per output token, end-to-end latency,
  queue time, swap-blocked time) that merge by adding counts, so replicas can be summed;
* ``Snapshot``: one scheduler replica's metrics at one moment, plain JSON-able data;
* ``MetricsHub``: the state of the small ``Metrics`` deployment. Every ``Scheduler`` replica
  publishes its snapshot there periodically; any ``Ingress`` replica renders the sum of the fresh
  ones, so ``/metrics`` shows the whole application whichever replica answers;
* ``render``: the Prometheus text format (version 0.0.4).

No Ray, no torch: the hub and the renderer are plain Python, testable alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "fastserve_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets (seconds): from a fast decode step on a GPU to a long CPU request.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
    40.0, 80.0, 160.0,
)
HISTOGRAMS: dict[str, str] = {
    "time_to_first_token_seconds": "Time from arrival at the scheduler to the first token.",
    "time_per_output_token_seconds": "Mean time between output tokens after the first, per request.",
    "e2e_request_latency_seconds": "Time from arrival at the scheduler to the last token.",
    "request_queue_time_seconds": "Time a request waited in the scheduler's queues, not running.",
    "request_swap_blocked_time_seconds": "Time a request was picked but its KV was on the host.",
}
COUNTERS: dict[str, str] = {
    "requests_total": "Requests finished, by finish reason (stop, length, abort, error).",
    "prompt_tokens_total": "Prompt tokens of finished requests.",
    "generation_tokens_total": "Tokens generated.",
    "swaps_total": "Jobs whose KV was swapped, by direction (out: device->host, in: host->device).",
    "swapped_blocks_total": "KV blocks swapped, by direction.",
    "recomputes_total": "Jobs whose KV was dropped and recomputed.",
    "promotions_total": "Starvation promotions to the highest MLFQ level.",
    "demotions_total": "MLFQ demotions after a quantum was used up.",
    "scheduler_steps_total": "Iterations the engine ran.",
    "requests_rejected_total": "Requests refused because the admission queue was full.",
}
GAUGES: dict[str, str] = {
    "jobs_running": "Jobs in an in-flight iteration, by MLFQ level.",
    "jobs_waiting": "Active jobs not in an in-flight iteration, by MLFQ level.",
    "admission_queue_jobs": "Jobs waiting for admission (no KV anywhere yet).",
    "kv_device_blocks_used": "Device KV blocks owned by jobs or in flight.",
    "kv_device_blocks_total": "Device KV blocks in the pool.",
    "kv_host_blocks_used": "Host KV blocks owned by jobs or in flight.",
    "kv_host_blocks_total": "Host KV blocks in the pool.",
    "scheduler_replicas": "Scheduler replicas whose metrics are included.",
}

Labels = tuple[tuple[str, str], ...]


def labels(**kv: object) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in kv.items()))


@dataclass
class Histogram:
    """A Prometheus histogram: ``counts[i]`` observations ≤ ``buckets[i]`` (not cumulative here)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)   # last slot: +Inf

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.count += 1

    def merge(self, other: Histogram) -> None:
        if other.buckets != self.buckets:
            raise ValueError("cannot merge histograms with different buckets")
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total
        self.count += other.count

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total,
                "count": self.count}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Histogram:
        return cls(tuple(raw["buckets"]), list(raw["counts"]), float(raw["sum"]), int(raw["count"]))


@dataclass
class Snapshot:
    """One replica's metrics: histograms by name, counters and gauges as labelled samples."""

    replica: str
    taken_at: float
    histograms: dict[str, Histogram] = field(default_factory=dict)
    counters: dict[tuple[str, Labels], float] = field(default_factory=dict)
    gauges: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica, "taken_at": self.taken_at,
            "histograms": {k: h.to_dict() for k, h in self.histograms.items()},
            "counters": [[n, list(map(list, lb)), v] for (n, lb), v in self.counters.items()],
            "gauges": [[n, list(map(list, lb)), v] for (n, lb), v in self.gauges.items()],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Snapshot:
        def samples(rows: Iterable[Sequence[Any]]) -> dict[tuple[str, Labels], float]:
            return {(str(n), tuple((str(k), str(v)) for k, v in lb)): float(v) for n, lb, v in rows}

        return cls(str(raw["replica"]), float(raw["taken_at"]),
                   {k: Histogram.from_dict(h) for k, h in raw["histograms"].items()},
                   samples(raw["counters"]), samples(raw["gauges"]))


class RequestMetrics:
    """What one scheduler replica records per request, kept for its snapshots."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram() for name in HISTOGRAMS}
        self.counters: dict[tuple[str, Labels], float] = {}

    def count(self, name: str, value: float = 1.0, **label: object) -> None:
        key = (name, labels(**label))
        self.counters[key] = self.counters.get(key, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def observe_request(self, *, ttft: float | None, e2e: float, num_generated: int,
                        queue: float, swap_blocked: float) -> None:
        if ttft is not None:
            self.observe("time_to_first_token_seconds", ttft)
            if num_generated > 1:
                self.observe("time_per_output_token_seconds", (e2e - ttft) / (num_generated - 1))
        self.observe("e2e_request_latency_seconds", e2e)
        self.observe("request_queue_time_seconds", queue)
        self.observe("request_swap_blocked_time_seconds", swap_blocked)

    def snapshot(self, replica: str, gauges: dict[tuple[str, Labels], float],
                 counters: dict[tuple[str, Labels], float]) -> Snapshot:
        merged = dict(self.counters)
        for key, value in counters.items():
            merged[key] = merged.get(key, 0.0) + value
        hist = {k: Histogram.from_dict(h.to_dict()) for k, h in self.histograms.items()}
        return Snapshot(replica, time.time(), hist, merged, dict(gauges))


class MetricsHub:
    """Latest snapshot per scheduler replica; renders their sum. State of the Metrics deployment."""

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._snapshots: dict[str, Snapshot] = {}

    def publish(self, raw: dict[str, Any]) -> None:
        snap = Snapshot.from_dict(raw)
        self._snapshots[snap.replica] = snap

    def fresh(self, now: float | None = None) -> list[Snapshot]:
        now = time.time() if now is None else now
        self._snapshots = {k: s for k, s in self._snapshots.items()
                           if now - s.taken_at <= self.stale_after_s}
        return list(self._snapshots.values())

    def render(self) -> str:
        return render(self.fresh())


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _sample(name: str, lb: Labels, value: float) -> str:
    if not lb:
        return f"{PREFIX}{name} {_fmt(value)}"
    inner = ",".join(f'{k}="{v}"' for k, v in lb)
    return f"{PREFIX}{name}{{{inner}}} {_fmt(value)}"


def render(snapshots: Sequence[Snapshot]) -> str:
    """Prometheus text of the sum over ``snapshots`` (every declared metric, even when zero)."""
    hists = {name: Histogram() for name in HISTOGRAMS}
    counters: dict[tuple[str, Labels], float] = {}
    gauges: dict[tuple[str, Labels], float] = {("scheduler_replicas", ()): float(len(snapshots))}
    for snap in snapshots:
        for name, h in snap.histograms.items():
            if name in hists:
                hists[name].merge(h)
        for bucket, target in ((snap.counters, counters), (snap.gauges, gauges)):
            for key, value in bucket.items():
                target[key] = target.get(key, 0.0) + value
    lines: list[str] = []
    for name, help_ in HISTOGRAMS.items():
        lines += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} histogram"]
        h, cumulative = hists[name], 0
        for bound, n in zip((*h.buckets, math.inf), h.counts, strict=True):
            cumulative += n
            lines.append(_sample(f"{name}_bucket", (("le", _fmt(bound)),), cumulative))
        lines += [_sample(f"{name}_sum", (), h.total), _sample(f"{name}_count", (), h.count)]
    for kind, declared, values in (("counter", COUNTERS, counters), ("gauge", GAUGES, gauges)):
        for name, help_ in declared.items():
            lines += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}"]
            rows = sorted((lb, v) for (n, lb), v in values.items() if n == name)
            lines += [_sample(name, lb, v) for lb, v in rows] or [_sample(name, (), 0.0)]
    return "\n".join(lines) + "\n"
