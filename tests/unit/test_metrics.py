"""Metric definitions against hand-computed values; throughput at SLO on synthetic curves."""

from __future__ import annotations

import math

import pytest

from fastserve.bench.metrics import (
    METRIC_E2E,
    METRIC_PER_TOKEN,
    METRIC_TPOT,
    METRIC_TTFT,
    STATUS_INTERPOLATED,
    STATUS_LOWER_BOUND,
    STATUS_NONE_UNDER,
    RequestRecord,
    goodput,
    latency_breakdown,
    latency_stats,
    meets_slo,
    request_metrics,
    slo_attainment,
    summarize,
    throughput_at_slo,
)

EPS = 1e-12

# Arrives at 0, tokens at 1.0 .. 3.0 every 0.5 s: TTFT 1, TPOT 0.5, E2E 3, per-token 3/5.
STREAMED = RequestRecord(
    arrival=0.0,
    first_token=1.0,
    end=3.0,
    output_tokens=5,
    token_times=(1.0, 1.5, 2.0, 2.5, 3.0),
    queue_s=0.5,
    exec_s=2.0,
    swap_s=0.25,
)
# No per-token timestamps: TPOT falls back to (end - first) / (n - 1) = (6 - 2) / 4 = 1.
CHUNKED = RequestRecord(arrival=1.0, first_token=2.0, end=6.0, output_tokens=5, token_times=(2.0,))
# A one-token answer: TPOT undefined.
SINGLE = RequestRecord(arrival=2.0, first_token=2.5, end=2.5, output_tokens=1, token_times=(2.5,))
FAILED = RequestRecord(arrival=3.0, first_token=None, end=None, output_tokens=0, status="error")


def test_request_metrics_streamed() -> None:
    m = request_metrics(STREAMED)
    assert m is not None
    assert m.ttft == 1.0
    assert m.tpot == 0.5
    assert m.e2e == 3.0
    assert m.per_token == pytest.approx(0.6, abs=EPS)


def test_request_metrics_chunked_and_single() -> None:
    chunked = request_metrics(CHUNKED)
    assert chunked is not None
    assert (chunked.ttft, chunked.tpot, chunked.e2e, chunked.per_token) == (1.0, 1.0, 5.0, 1.0)
    single = request_metrics(SINGLE)
    assert single is not None
    assert single.tpot is None
    assert single.per_token == 0.5


def test_failed_request_has_no_metrics() -> None:
    assert request_metrics(FAILED) is None
    assert not meets_slo(FAILED, 100.0)


def test_latency_stats_linear_percentiles() -> None:
    stats = latency_stats([4.0, 1.0, 3.0, 2.0])
    assert stats.count == 4
    assert stats.mean == 2.5
    assert stats.p50 == 2.5
    assert stats.p95 == pytest.approx(3.85, abs=EPS)  # 1 + 0.95 * 3
    assert stats.p99 == pytest.approx(3.97, abs=EPS)
    assert stats.max == 4.0


def test_latency_stats_empty_is_nan_and_null_in_dict() -> None:
    stats = latency_stats([])
    assert stats.count == 0
    assert math.isnan(stats.mean)
    assert stats.to_dict()["p95"] is None


def test_slo_attainment_and_goodput() -> None:
    records = [STREAMED, CHUNKED, SINGLE, FAILED]
    # per-token latencies: 0.6, 1.0, 0.5; the failed request counts as a miss.
    assert slo_attainment(records, 0.6) == 0.5
    assert slo_attainment(records, 1.0) == 0.75
    assert slo_attainment(records, 0.1) == 0.0
    # Duration: first arrival 0 to last end 6.
    assert goodput(records, 1.0) == 3 / 6
    assert goodput(records, 0.6, duration_s=4.0) == 2 / 4


def test_multi_metric_slo() -> None:
    slo = {METRIC_TTFT: 1.0, METRIC_TPOT: 0.5}
    assert meets_slo(STREAMED, slo)
    assert not meets_slo(CHUNKED, slo)  # TPOT 1.0 > 0.5
    assert meets_slo(SINGLE, slo)  # TPOT undefined does not count against it
    assert not meets_slo(STREAMED, {METRIC_E2E: 2.9})
    with pytest.raises(ValueError):
        meets_slo(STREAMED, {"bogus": 1.0})


def test_latency_breakdown_shares() -> None:
    breakdown = latency_breakdown([STREAMED, CHUNKED, FAILED])
    # Only STREAMED reports a breakdown: 0.5 + 2.0 + 0.25 of an E2E of 3.0.
    assert breakdown.requests == 1
    assert breakdown.queue_share == pytest.approx(0.5 / 3, abs=EPS)
    assert breakdown.exec_share == pytest.approx(2.0 / 3, abs=EPS)
    assert breakdown.swap_share == pytest.approx(0.25 / 3, abs=EPS)
    assert breakdown.other_share == pytest.approx(0.25 / 3, abs=EPS)
    assert breakdown.mean_exec_s == 2.0


def test_latency_breakdown_clock_skew_has_no_negative_other() -> None:
    skewed = RequestRecord(0.0, 0.5, 1.0, 2, queue_s=1.0, exec_s=1.0, swap_s=0.0)
    breakdown = latency_breakdown([skewed])
    assert breakdown.other_share == 0.0
    assert breakdown.queue_share == 0.5


def test_summarize() -> None:
    summary = summarize([STREAMED, CHUNKED, SINGLE, FAILED], slo=1.0)
    assert (summary.num_requests, summary.num_completed, summary.num_failed) == (4, 3, 1)
    assert summary.duration_s == 6.0
    assert summary.request_throughput == 0.5
    assert summary.output_token_throughput == 11 / 6
    assert summary.ttft.mean == pytest.approx((1.0 + 1.0 + 0.5) / 3, abs=EPS)
    assert summary.tpot.count == 2
    assert summary.tpot.mean == 0.75
    assert summary.e2e.max == 5.0
    assert summary.per_token.count == 3
    assert summary.slo == {METRIC_PER_TOKEN: 1.0}
    assert summary.slo_attainment == 0.75
    assert summary.goodput == 0.5
    as_dict = summary.to_dict()
    assert as_dict["per_token"]["count"] == 3
    assert as_dict["breakdown"]["requests"] == 1


def test_record_dict_round_trip() -> None:
    assert RequestRecord.from_dict(STREAMED.to_dict()) == STREAMED
    minimal = RequestRecord.from_dict({"arrival": 1, "end": 2, "output_tokens": 3})
    assert minimal.ok and minimal.first_token is None and minimal.token_times == ()


RATES = [1.0, 2.0, 3.0, 4.0]


def test_throughput_at_slo_interpolates() -> None:
    result = throughput_at_slo(RATES, [0.1, 0.2, 0.4, 0.8], slo=0.3)
    assert result.status == STATUS_INTERPOLATED
    assert result.bracket == (2.0, 3.0)
    assert result.rate == pytest.approx(2.5, abs=EPS)  # 2 + (0.3 - 0.2) / (0.4 - 0.2)


def test_throughput_at_slo_unsorted_and_exact_hit() -> None:
    result = throughput_at_slo([3.0, 1.0, 2.0], [0.5, 0.1, 0.3], slo=0.3)
    # Latency exactly at the SLO counts as under; the crossing is between 2 and 3.
    assert result.bracket == (2.0, 3.0)
    assert result.rate == 2.0


def test_throughput_at_slo_stops_at_first_crossing() -> None:
    # A noisy dip back under at rate 3 does not count: rate 2 already missed the SLO.
    result = throughput_at_slo(RATES, [0.1, 0.5, 0.2, 0.9], slo=0.3)
    assert result.bracket == (1.0, 2.0)
    assert result.rate == pytest.approx(1.5, abs=EPS)


def test_throughput_at_slo_all_under_is_lower_bound() -> None:
    result = throughput_at_slo(RATES, [0.1, 0.1, 0.2, 0.25], slo=0.3)
    assert result.status == STATUS_LOWER_BOUND
    assert result.is_lower_bound
    assert result.rate == 4.0
    assert result.bracket is None


def test_throughput_at_slo_none_under() -> None:
    result = throughput_at_slo(RATES, [0.4, 0.5, 0.6, 0.7], slo=0.3)
    assert result.status == STATUS_NONE_UNDER
    assert result.rate == 0.0
    assert result.to_dict() == {"rate": 0.0, "status": STATUS_NONE_UNDER, "bracket": None}


def test_throughput_at_slo_nan_counts_as_over() -> None:
    result = throughput_at_slo(RATES, [0.1, 0.2, math.nan, 0.1], slo=0.3)
    assert result.bracket == (2.0, 3.0)
    assert result.rate == 2.0


@pytest.mark.parametrize(
    ("rates", "latencies"), [([], []), ([1.0], [0.1, 0.2]), ([1.0, 1.0], [0.1, 0.2])]
)
def test_throughput_at_slo_rejects_bad_input(rates: list[float], latencies: list[float]) -> None:
    with pytest.raises(ValueError):
        throughput_at_slo(rates, latencies, slo=0.3)
