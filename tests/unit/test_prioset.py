"""The decision's small data structures, exactly: ``PrioritySet`` walks in (key, insertion) order
past stale entries, a re-added job goes behind its equals unless it was discarded and comes back
with its old key while its entry is still in the heap, a walk removes nothing and refuses a set
changed under it, ``StarvationClocks``
keeps one due per job, and ``Job.tokens_between`` is a slice of ``Job.tokens``."""

from __future__ import annotations

import pytest

from fastserve.scheduler.job import Job
from fastserve.scheduler.prioset import PrioritySet
from fastserve.scheduler.queues import StarvationClocks
from fastserve.worker.messages import SamplingParams


def test_a_walk_goes_by_key_then_insertion_and_skips_discarded_and_replaced_entries() -> None:
    s = PrioritySet()
    for job_id, key in (("a", 2.0), ("b", 1.0), ("c", 2.0), ("d", 1.0), ("e", 3.0)):
        s.add(job_id, key)
    s.discard("b")
    s.add("d", 1.0)      # re-added: behind nothing, its old entry is stale
    s.add("a", 2.0)      # re-added with an equal key: now behind "c"
    assert list(s.ordered()) == [(1.0, "d"), (2.0, "c"), (2.0, "a"), (3.0, "e")]
    assert s.peek() == (1.0, "d") and len(s) == 4
    for job_id in "dcae":
        s.discard(job_id)
    assert len(s) == 0 and not s and s.peek() is None and list(s.ordered()) == []


def test_a_walk_goes_by_key_then_insertion_and_removes_nothing() -> None:
    s = PrioritySet()
    for i in range(50):
        s.add(f"j{i}", float((i * 7) % 5))
    s.discard("j3")
    s.add("j4", -1.0)                     # moved to the front; its old entry is stale
    rest = sorted(((i * 7) % 5, i) for i in range(50) if i not in (3, 4))
    walked = list(s.ordered())
    assert walked == [(-1.0, "j4")] + [(float(k), f"j{i}") for k, i in rest]
    assert len(s) == 49 and list(s.ordered()) == walked


def test_a_discarded_job_back_with_its_old_key_keeps_its_place() -> None:
    s = PrioritySet()
    for job_id in "abc":
        s.add(job_id, 1.0)
    s.discard("a")
    s.add("a", 1.0)                       # back with the same key: ahead of b and c, as before
    s.discard("b")
    s.add("b", 2.0)                       # a new key: a new entry
    assert [k for _, k in s.ordered()] == ["a", "c", "b"]
    s.discard("a")
    s.discard("c")
    assert s.peek() == (2.0, "b")         # the stale entries of a and c left the heap's root for good
    s.add("c", 1.0)                       # so c's comes back as a new entry, not a revived lost one
    assert list(s.ordered()) == [(1.0, "c"), (2.0, "b")]


def test_a_set_changed_while_walked_ends_the_walk() -> None:
    s = PrioritySet()
    for i in range(5):
        s.add(f"j{i}", float(i))
    walk = s.ordered()
    assert next(walk) == (0.0, "j0")
    s.add("late", 9.0)
    with pytest.raises(RuntimeError, match="changed while walked"):
        next(walk)


def test_compaction_keeps_every_live_entry_in_order() -> None:
    s = PrioritySet()
    for i in range(200):
        s.add(f"j{i % 10}", float(i % 7))   # 190 stale entries: compacts several times
    expected = sorted((i % 7, i) for i in range(190, 200))
    assert list(s.ordered()) == [(float(k), f"j{i % 10}") for k, i in expected]


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
