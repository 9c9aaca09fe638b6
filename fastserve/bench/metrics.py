"""Load-test metrics with the paper's definitions: per request TTFT, TPOT, E2E and per-token latency
(E2E ÷ output tokens, §6.1); their aggregates, SLO attainment, the Figure 15b breakdown; and
``throughput_at_slo`` (Figures 11-12). Pure functions over plain records, numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np

__all__ = [
    "METRIC_E2E",
    "METRIC_PER_TOKEN",
    "METRIC_TPOT",
    "METRIC_TTFT",
    "STATUS_INTERPOLATED",
    "STATUS_LOWER_BOUND",
    "STATUS_NONE_UNDER",
    "STATUS_OK",
    "LatencyBreakdown",
    "LatencyStats",
    "RequestMetrics",
    "RequestRecord",
    "RunSummary",
    "SLORatio",
    "ThroughputAtSLO",
    "goodput",
    "latency_breakdown",
    "latency_stats",
    "meets_slo",
    "request_metrics",
    "slo_attainment",
    "slo_ratio",
    "summarize",
    "throughput_at_slo",
]

STATUS_OK = "ok"

METRIC_TTFT = "ttft"
METRIC_TPOT = "tpot"
METRIC_E2E = "e2e"
METRIC_PER_TOKEN = "per_token"
_METRICS = (METRIC_TTFT, METRIC_TPOT, METRIC_E2E, METRIC_PER_TOKEN)

_P50 = 50.0
_P95 = 95.0
_P99 = 99.0
_PERCENTILE_METHOD: Final = "linear"

STATUS_INTERPOLATED = "interpolated"
STATUS_LOWER_BOUND = "lower_bound"  # every measured rate met the SLO: the true value is higher
STATUS_NONE_UNDER = "none_under"  # even the lowest measured rate missed the SLO


def _nan_to_none(value: Any) -> Any:
    """JSON has no NaN; empty aggregates serialize as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_nan_to_none(v) for v in value]
    return value




@dataclass(frozen=True)
class RequestRecord:
    """One request as observed, seconds on one clock; `token_times`: one per streamed chunk;
    `queue_s`, `exec_s`, `swap_s`: the server's own breakdown."""

    arrival: float
    first_token: float | None
    end: float | None
    output_tokens: int
    status: str = STATUS_OK
    token_times: tuple[float, ...] = ()
    queue_s: float | None = None
    exec_s: float | None = None
    swap_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK and self.end is not None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        return cls(
            arrival=float(data["arrival"]),
            first_token=_optional_float(data.get("first_token")),
            end=_optional_float(data.get("end")),
            output_tokens=int(data.get("output_tokens", 0)),
            status=str(data.get("status", STATUS_OK)),
            token_times=tuple(float(t) for t in data.get("token_times") or ()),
            queue_s=_optional_float(data.get("queue_s")),
            exec_s=_optional_float(data.get("exec_s")),
            swap_s=_optional_float(data.get("swap_s")),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["token_times"] = list(self.token_times)
        return out


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one completed request (seconds); None where undefined (e.g. TPOT of 1 token)."""

    ttft: float | None
    tpot: float | None
    e2e: float
    per_token: float | None

    def get(self, metric: str) -> float | None:
        if metric not in _METRICS:
            raise ValueError(f"unknown metric {metric!r}; expected one of {_METRICS}")
        value: float | None = getattr(self, metric)
        return value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tpot(record: RequestRecord) -> float | None:
    """Mean gap between tokens after the first; (end - first) / (n - 1) when chunks carry several (vLLM's)."""
    n = record.output_tokens
    if n < 2 or record.first_token is None:
        return None
    times = record.token_times
    if len(times) == n:
        return (times[-1] - times[0]) / (n - 1)
    if record.end is None:
        return None
    return (record.end - record.first_token) / (n - 1)


def request_metrics(record: RequestRecord) -> RequestMetrics | None:
    """Latencies of a completed request; None for failed or unfinished ones."""
    if not record.ok or record.end is None:
        return None
    e2e = record.end - record.arrival
    return RequestMetrics(
        ttft=None if record.first_token is None else record.first_token - record.arrival,
        tpot=_tpot(record),
        e2e=e2e,
        per_token=e2e / record.output_tokens if record.output_tokens > 0 else None,
    )




@dataclass(frozen=True)
class LatencyStats:
    """Mean and linear-interpolated percentiles; NaN (null in to_dict) when there are no samples."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _nan_to_none(asdict(self))
        return out


def latency_stats(values: Sequence[float] | np.ndarray) -> LatencyStats:
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return LatencyStats(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    p50, p95, p99 = np.percentile(data, [_P50, _P95, _P99], method=_PERCENTILE_METHOD)
    return LatencyStats(
        count=int(data.size),
        mean=float(data.mean()),
        p50=float(p50),
        p95=float(p95),
        p99=float(p99),
        max=float(data.max()),
    )


def _normalize_slo(slo: float | Mapping[str, float]) -> dict[str, float]:
    slos = {METRIC_PER_TOKEN: float(slo)} if isinstance(slo, int | float) else dict(slo)
    for metric in slos:
        if metric not in _METRICS:
            raise ValueError(f"unknown SLO metric {metric!r}; expected one of {_METRICS}")
    return slos


def meets_slo(record: RequestRecord, slo: float | Mapping[str, float]) -> bool:
    """Completed and every named metric within bound; a bare number is a per-token SLO (the paper's).
    An undefined metric (TPOT of one token) does not count against it."""
    metrics = request_metrics(record)
    if metrics is None:
        return False
    for metric, bound in _normalize_slo(slo).items():
        value = metrics.get(metric)
        if value is not None and value > bound:
            return False
    return True


def slo_attainment(records: Sequence[RequestRecord], slo: float | Mapping[str, float]) -> float:
    """Fraction of all requests (failed ones count as misses) that meet the SLO."""
    if not records:
        return math.nan
    return sum(meets_slo(r, slo) for r in records) / len(records)


def _run_duration(records: Sequence[RequestRecord]) -> float:
    ends = [r.end for r in records if r.end is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.arrival for r in records)


def goodput(
    records: Sequence[RequestRecord],
    slo: float | Mapping[str, float],
    duration_s: float | None = None,
) -> float:
    """Completed requests per second that met the SLO (duration: first arrival to last end)."""
    duration = _run_duration(records) if duration_s is None else duration_s
    if duration <= 0:
        return math.nan
    return sum(meets_slo(r, slo) for r in records) / duration


@dataclass(frozen=True)
class LatencyBreakdown:
    """Shares of E2E latency (Figure 15b); `other` is what the server's parts do not explain (0 on skew)."""

    requests: int
    queue_share: float
    exec_share: float
    swap_share: float
    other_share: float
    mean_queue_s: float
    mean_exec_s: float
    mean_swap_s: float

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _nan_to_none(asdict(self))
        return out


def latency_breakdown(records: Sequence[RequestRecord]) -> LatencyBreakdown:
    rows = [
        (r.queue_s or 0.0, r.exec_s or 0.0, r.swap_s or 0.0, r.end - r.arrival)
        for r in records
        if r.ok and r.end is not None and (r.queue_s, r.exec_s, r.swap_s) != (None, None, None)
    ]
    if not rows:
        nan = math.nan
        return LatencyBreakdown(0, nan, nan, nan, nan, nan, nan, nan)
    queue, execute, swap, e2e = (float(sum(col)) for col in zip(*rows, strict=True))
    explained = queue + execute + swap
    total = max(e2e, explained)
    if total <= 0:
        total = math.nan
    n = len(rows)
    return LatencyBreakdown(
        requests=n,
        queue_share=queue / total,
        exec_share=execute / total,
        swap_share=swap / total,
        other_share=(total - explained) / total,
        mean_queue_s=queue / n,
        mean_exec_s=execute / n,
        mean_swap_s=swap / n,
    )


@dataclass(frozen=True)
class RunSummary:

    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    per_token: LatencyStats
    breakdown: LatencyBreakdown
    slo: dict[str, float] | None = None
    slo_attainment: float | None = None
    goodput: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _nan_to_none(asdict(self))
        return out


def _stats_of(metrics: Sequence[RequestMetrics], metric: str) -> LatencyStats:
    return latency_stats([v for m in metrics if (v := m.get(metric)) is not None])


def summarize(
    records: Sequence[RequestRecord],
    slo: float | Mapping[str, float] | None = None,
    duration_s: float | None = None,
) -> RunSummary:
    """Aggregate a run. Latency statistics cover completed requests only."""
    completed = [r for r in records if r.ok]
    metrics = [m for r in completed if (m := request_metrics(r)) is not None]
    duration = _run_duration(records) if duration_s is None else duration_s
    rate_denominator = duration if duration > 0 else math.nan
    slos = None if slo is None else _normalize_slo(slo)
    return RunSummary(
        num_requests=len(records),
        num_completed=len(completed),
        num_failed=len(records) - len(completed),
        duration_s=duration,
        request_throughput=len(completed) / rate_denominator,
        output_token_throughput=sum(r.output_tokens for r in completed) / rate_denominator,
        ttft=_stats_of(metrics, METRIC_TTFT),
        tpot=_stats_of(metrics, METRIC_TPOT),
        e2e=_stats_of(metrics, METRIC_E2E),
        per_token=_stats_of(metrics, METRIC_PER_TOKEN),
        breakdown=latency_breakdown(records),
        slo=slos,
        slo_attainment=None if slos is None else slo_attainment(records, slos),
        goodput=None if slos is None else goodput(records, slos, duration),
    )




@dataclass(frozen=True)
class ThroughputAtSLO:
    """Largest arrival rate whose latency stays under the SLO, interpolated within `bracket`."""

    rate: float
    status: str
    bracket: tuple[float, float] | None

    @property
    def is_lower_bound(self) -> bool:
        return self.status == STATUS_LOWER_BOUND

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "status": self.status,
            "bracket": None if self.bracket is None else list(self.bracket),
        }


#: How an SLO-throughput ratio bounds the truth.
RATIO_EXACT = "exact"          # both crossings measured (or ours below the grid: 0)
RATIO_AT_LEAST = "at_least"    # ours never crossed on the grid, the peer did
RATIO_AT_MOST = "at_most"      # the peer never crossed, ours did
RATIO_UNKNOWN = "unknown"      # neither crossed inside the grid, or both missed its lowest rate


@dataclass(frozen=True)
class SLORatio:
    """Ours ÷ the peer's at one SLO; a rate under the SLO to the grid's end is only a lower bound."""

    value: float | None
    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "kind": self.kind}

    def __str__(self) -> str:
        if self.value is None:
            return ("unbounded (the peer missed the SLO at every rate)" if self.kind == RATIO_AT_LEAST
                    else "unmeasured (neither crossed inside the grid)")
        prefix = {RATIO_AT_LEAST: "≥ ", RATIO_AT_MOST: "≤ "}.get(self.kind, "")
        return f"{prefix}{self.value:.2f}"


def slo_ratio(ours: ThroughputAtSLO, peer: ThroughputAtSLO) -> SLORatio:
    if ours.status == STATUS_NONE_UNDER and peer.status == STATUS_NONE_UNDER:
        return SLORatio(None, RATIO_UNKNOWN)
    if ours.is_lower_bound and peer.is_lower_bound:
        return SLORatio(None, RATIO_UNKNOWN)
    if peer.rate <= 0:
        return SLORatio(None, RATIO_AT_LEAST if ours.rate > 0 else RATIO_UNKNOWN)
    kind = RATIO_AT_LEAST if ours.is_lower_bound else RATIO_AT_MOST if peer.is_lower_bound else RATIO_EXACT
    return SLORatio(ours.rate / peer.rate, kind)


def throughput_at_slo(
    rates: Sequence[float], latencies: Sequence[float], slo: float
) -> ThroughputAtSLO:
    """The paper's throughput metric: the first rate over the SLO ends the search (a noisy dip after
    it does not count; NaN counts as over), linear in rate within the bracket."""
    if len(rates) != len(latencies) or not rates:
        raise ValueError("need as many latencies as rates, and at least one point")
    points = sorted(zip(rates, latencies, strict=True))
    if len({r for r, _ in points}) != len(points):
        raise ValueError("rates must be distinct")

    def over(latency: float) -> bool:
        return math.isnan(latency) or latency > slo

    first_over = next((i for i, (_, lat) in enumerate(points) if over(lat)), None)
    if first_over is None:
        return ThroughputAtSLO(points[-1][0], STATUS_LOWER_BOUND, None)
    if first_over == 0:
        return ThroughputAtSLO(0.0, STATUS_NONE_UNDER, None)
    (r_lo, l_lo), (r_hi, l_hi) = points[first_over - 1], points[first_over]
    if math.isnan(l_hi):
        # No latency to interpolate towards: the last rate known to be under is the answer.
        return ThroughputAtSLO(r_lo, STATUS_INTERPOLATED, (r_lo, r_hi))
    rate = r_lo + (slo - l_lo) * (r_hi - r_lo) / (l_hi - l_lo)
    return ThroughputAtSLO(rate, STATUS_INTERPOLATED, (r_lo, r_hi))
