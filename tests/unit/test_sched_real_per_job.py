"""The per-job figures ``fastserve.bench.experiments.sched_real`` reports from responses' ``job_stats``."""

from __future__ import annotations

from fastserve.bench.experiments.sched_real import per_job


def test_per_job_reports_means_and_the_worst_job() -> None:
    records = [
        {"server": {"demotions": 4, "promotions": 1, "swaps_out": 3, "swap_blocked_s": 0.5,
                    "longest_swap_blocked_s": 0.25}},
        {"server": {"demotions": 2, "promotions": 0, "swaps_out": 0, "swap_blocked_s": 0.1,
                    "longest_swap_blocked_s": 0.0}},
        {"server": None},     # a request that failed before it was a job
    ]
    assert per_job(records) == {"jobs": 2, "demotions": 3.0, "promotions": 0.5, "promotions_max": 1.0,
                                "swaps_out": 1.5, "swaps_out_max": 3.0, "kv_wait_mean_s": 0.3,
                                "kv_wait_max_s": 0.25}


def test_per_job_is_empty_without_job_stats() -> None:
    assert per_job([{"server": None}]) == {}
