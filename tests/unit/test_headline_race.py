"""The headline race's own arithmetic (no servers): vLLM's counters per point, our per-job
figures from ``job_stats``, the SLO ratios and the apps' overrides."""

from __future__ import annotations

import math

from fastserve.bench.experiments import headline_race as H
from fastserve.bench.metrics import STATUS_INTERPOLATED, STATUS_LOWER_BOUND, ThroughputAtSLO


def test_vllm_point_diffs_counters_per_job_and_per_request() -> None:
    before = {"vllm:num_preemptions": 3.0, "vllm:request_queue_time_seconds_sum": 1.0,
              "vllm:request_queue_time_seconds_count": 2.0}
    after = {"vllm:num_preemptions": 13.0, "vllm:request_queue_time_seconds_sum": 9.0,
             "vllm:request_queue_time_seconds_count": 6.0}
    point = H.vllm_point(before, after, jobs=5)
    assert point["preemptions"] == 2.0 and point["queue_time_s"] == 2.0
    assert math.isnan(point["decode_time_s"])       # no request finished a decode: no mean


def test_our_jobs_shares_sum_to_one() -> None:
    records = [{"server": {"queue_s": 1.0, "exec_s": 2.0, "swap_blocked_s": 1.0, "swaps_out": 2,
                           "recomputes": 0, "promotions": 1}},
               {"server": {"queue_s": 0.0, "exec_s": 4.0, "swap_blocked_s": 0.0, "swaps_out": 0,
                           "recomputes": 1, "promotions": 0}}]
    jobs = H.our_jobs(records)
    assert jobs["swaps_out"] == 1.0 and jobs["preemptions"] == 1.5 and jobs["promotions"] == 0.5
    assert (jobs["queue_s_share"], jobs["exec_s_share"], jobs["swap_blocked_s_share"]) == (0.125, 0.75, 0.125)


def test_slo_ratios_mark_a_side_that_never_crossed() -> None:
    crossed = ThroughputAtSLO(2.0, STATUS_INTERPOLATED, (1.0, 3.0))
    held = ThroughputAtSLO(8.0, STATUS_LOWER_BOUND, None)
    at = {"vllm": {"mean": crossed, "p95": crossed}, "skip_join": {"mean": held, "p95": crossed},
          "fcfs": {"mean": crossed, "p95": crossed}}
    ratios = H.slo_ratios(at)
    assert ratios["skip_join/vllm"]["mean"] == {"value": 4.0, "kind": "at_least"}
    assert ratios["skip_join/vllm"]["p95"] == {"value": 1.0, "kind": "exact"}
    assert "reactive/vllm" not in ratios


def test_both_servers_get_the_same_device_kv() -> None:
    args = H.parse_args(["--vllm-url", "http://127.0.0.1:8100", "--kv-tokens", "8192"])
    assert H.our_overrides(args)["kv_cache"]["num_device_blocks"] * 16 == 8192
    assert 8192 // H.VLLM_BLOCK_SIZE == 64


def test_a_system_past_its_crossing_counts_only_points_over_at_both_statistics() -> None:
    points = [{"per_token_mean_s": 0.1, "per_token_p95_s": 0.2},
              {"per_token_mean_s": 0.3, "per_token_p95_s": 0.9},      # P95 over only: still under at the mean
              {"per_token_mean_s": 0.7, "per_token_p95_s": 1.5},
              {"per_token_mean_s": math.nan, "per_token_p95_s": math.nan}]
    assert H.points_over(points, 0.5) == 2
    assert H.curve_cell(None, 0.5) == "–"
    assert H.curve_cell(points[1], 0.5) == "0.300 / 0.900*"


def test_our_requests_are_bounded_by_the_point_not_the_demos_request_timeout() -> None:
    # vLLM ends no request on a timer: a shorter one on our side would drop our slowest jobs from the figures.
    args = H.parse_args(["--vllm-url", "http://127.0.0.1:8100", "--max-total-s", "1500"])
    server = H.our_overrides(args)["server"]
    assert server["request_timeout_s"] == server["admission_timeout_s"] == 1500
