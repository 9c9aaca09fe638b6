"""The engine replica's periodic stats line (``fastserve.engine.stats_log``): when it is due, what
it says, and how it stays quiet on an idle server. Fake gauges stand in for a scheduler."""

from __future__ import annotations

import logging

import pytest

from fastserve.config_server import ServerArgs
from fastserve.engine.stats_log import StatsLine, StatsLog


def gauges(running: int = 0, waiting: int = 0, swapped: int = 0, kv: float = 0.0) -> dict[str, float]:
    """``scheduler_gauges``' keys; ``num_requests_waiting`` (every active job not running) differs
    from the admission queue on purpose: the line's Waiting is the admission queue."""
    return {"num_requests_running": running, "num_requests_waiting": running + waiting + swapped + 7,
            "num_requests_swapped": swapped, "kv_cache_usage_perc": kv, "host_kv_cache_usage_perc": 0.0,
            "admission_queue_jobs": waiting}


def test_the_default_interval_is_vllms_five_seconds() -> None:
    assert ServerArgs().stats_log_interval_s == 5.0
    with pytest.raises(ValueError, match="stats_log_interval_s"):
        ServerArgs(stats_log_interval_s=-1)


def test_a_line_is_due_once_the_interval_passed_and_reports_rates_since_the_last() -> None:
    log = StatsLog(5.0, now=100.0)
    log.add_tokens(prompt_tokens=400, generation_tokens=30)
    assert log.observe(gauges(), 0, 0, now=104.9) is None
    log.add_tokens(prompt_tokens=100, generation_tokens=20)
    line = log.observe(gauges(running=3, waiting=2, swapped=1, kv=0.125), 30, 120, now=105.0)
    assert line == StatsLine(prompt_tokens_per_s=100.0, generation_tokens_per_s=10.0, running=3, waiting=2,
                             swapped=1, kv_usage=0.125, prefix_hit_rate=0.25)
    assert str(line) == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                         "Running: 3 reqs, Waiting: 2 reqs, Swapped: 1 reqs, KV cache usage: 12.5%, "
                         "Prefix cache hit rate: 25.0%")
    # The next interval starts empty: its tokens and its lookups only.
    log.add_tokens(prompt_tokens=0, generation_tokens=10)
    line = log.observe(gauges(running=1), 30 + 20, 120 + 80, now=110.0)
    assert line is not None
    assert (line.prompt_tokens_per_s, line.generation_tokens_per_s, line.prefix_hit_rate) == (0.0, 2.0, 0.25)


def test_no_lookups_is_a_zero_hit_rate_and_interval_zero_never_logs() -> None:
    line = StatsLog(1.0, now=0.0).observe(gauges(), 0, 0, now=1.0)
    assert line is not None and line.prefix_hit_rate == 0.0
    off = StatsLog(0.0, now=0.0)
    off.add_tokens(10, 10)
    assert off.observe(gauges(running=1), 0, 0, now=1e9) is None
    with pytest.raises(ValueError, match="-1"):
        StatsLog(-1.0, now=0.0)


def test_an_idle_server_logs_its_first_idle_line_then_goes_quiet() -> None:
    log = StatsLog(1.0, now=0.0)
    levels = []
    for t, running in ((1.0, 2), (2.0, 0), (3.0, 0), (4.0, 0), (5.0, 1)):
        line = log.observe(gauges(running=running), 0, 0, now=t)
        assert line is not None
        levels.append(log.level(line))
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO]
