"""The decision's small data structures, exactly: ``PrioritySet`` pops in (key, insertion) order
past stale entries, a re-added job goes behind its equals, ``StarvationClocks`` keeps one due
per job, and ``Job.tokens_between`` is a slice of ``Job.tokens``."""

from __future__ import annotations

import pytest

from fastserve.scheduler.job import Job
from fastserve.scheduler.prioset import PrioritySet
from fastserve.scheduler.queues import StarvationClocks
from fastserve.worker.messages import SamplingParams


def test_pop_goes_by_key_then_insertion_and_skips_discarded_and_replaced_entries() -> None:
    s = PrioritySet()
    for job_id, key in (("a", 2.0), ("b", 1.0), ("c", 2.0), ("d", 1.0), ("e", 3.0)):
        s.add(job_id, key)
    s.discard("b")
    s.add("d", 1.0)      # re-added: behind nothing, its old entry is stale
    s.add("a", 2.0)      # re-added with an equal key: now behind "c"
    assert [s.pop() for _ in range(5)] == [(1.0, "d"), (2.0, "c"), (2.0, "a"), (3.0, "e"), None]
    assert len(s) == 0 and not s


def test_compaction_keeps_every_live_entry_in_order() -> None:
    s = PrioritySet()
    for i in range(200):
        s.add(f"j{i % 10}", float(i % 7))   # 190 stale entries: compacts several times
    expected = sorted((i % 7, i) for i in range(190, 200))
    assert [s.pop() for _ in range(10)] == [(float(k), f"j{i % 10}") for k, i in expected]
    assert s.pop() is None


def test_starvation_clocks_keep_the_latest_due_per_job() -> None:
    clocks = StarvationClocks()
    clocks.add("a", 5.0)
    clocks.add("b", 3.0)
    clocks.add("b", 7.0)     # postponed
    assert clocks.first_overdue(4.0) is None
    assert clocks.first_overdue(5.5) == "a"
    clocks.discard("a")
    assert clocks.first_overdue(6.0) is None
    assert clocks.first_overdue(7.5) == "b"
    assert "b" in clocks and "a" not in clocks


@pytest.mark.parametrize(("start", "end"), [(0, 5), (1, 3), (2, 6), (5, 8), (6, 7), (0, 8), (7, 8)])
def test_tokens_between_is_a_slice_of_tokens(start: int, end: int) -> None:
    job = Job("j", (10, 11, 12, 13, 14), SamplingParams(max_tokens=8), arrival=0.0)
    job.generated.extend([20, 21, 22])
    assert job.tokens_between(start, end) == job.tokens()[start:end]
    assert job.num_tokens == 8
