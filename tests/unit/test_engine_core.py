"""``EngineCore``: the one step (schedule → execute → update) on the clock it is given."""

from __future__ import annotations

import pytest

from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.worker.messages import BatchPlan, StepOutput
from tests.harness.scheduling import TOKEN, ChargedExecutor, make, req


class BrokenExecutor:
    def execute(self, plan: BatchPlan) -> StepOutput:
        raise RuntimeError("the data plane fell over")


def test_a_step_schedules_at_the_clock_runs_the_plan_and_applies_it_when_it_returns() -> None:
    clock = VirtualClock(10.0)
    core = EngineCore(make("fcfs"), clock, check_invariants=True)
    core.add(req("a", 8, max_tokens=2))
    first = core.step(ChargedExecutor(clock, 0.5))
    assert first is not None and first.output is not None
    assert [e.job_id for e in first.plan.entries] == ["a"]
    assert [(d.job_id, d.token_id, d.finish_reason) for d in first.deltas] == [("a", TOKEN, None)]
    second = core.step(ChargedExecutor(clock, 1.0))
    assert second is not None
    [last] = second.deltas
    assert (last.token_id, last.finish_reason) == (TOKEN, "length")
    assert last.finish is not None and last.finish.stats is not None
    stats = last.finish.stats
    # Arrived at 10.0; the first token came back at 10.5 and the last at 11.5.
    assert (stats.arrival, stats.first_token_time, stats.finish_time) == (10.0, 10.5, 11.5)
    assert core.steps == 2
    assert not core.has_work()
    assert core.step(ChargedExecutor(clock, 1.0)) is None
    assert clock() == 11.5      # nothing ran, no time passed


def test_a_plan_that_raises_fails_its_own_jobs_and_the_core_goes_on() -> None:
    clock = VirtualClock()
    core = EngineCore(make("fcfs", batch=1), clock, check_invariants=True)
    core.add(req("a", 8))
    core.add(req("b", 8, max_tokens=1))
    failed = core.step(BrokenExecutor())
    assert failed is not None and failed.output is None
    assert [(d.job_id, d.finish_reason) for d in failed.deltas] == [("a", "error")]
    served = core.step(ChargedExecutor(clock, 1.0))
    assert served is not None
    assert [(d.job_id, d.finish_reason) for d in served.deltas] == [("b", "length")]


def test_the_halves_keep_plans_in_flight_between_them_as_a_pipeline_does() -> None:
    clock = VirtualClock()
    core = EngineCore(make("fcfs", batch=1), clock, check_invariants=True)
    core.add(req("a", 8, max_tokens=1))
    core.add(req("b", 8, max_tokens=1))
    plan_a, plan_b = core.schedule(), core.schedule()
    assert plan_a is not None and plan_b is not None
    assert core.schedule() is None          # both jobs are in flight
    clock.advance(2.0)
    outputs = [StepOutput(p.step_id, {e.job_id: TOKEN for e in p.entries}, {"total": 2.0})
               for p in (plan_a, plan_b)]
    done = [core.update(p, o).deltas for p, o in zip((plan_a, plan_b), outputs, strict=True)]
    assert [[(d.job_id, d.finish_reason) for d in ds] for ds in done] == [[("a", "length")], [("b", "length")]]
    assert core.steps == 2 and not core.has_work()


def test_abort_and_fail_all_end_jobs_through_the_core() -> None:
    clock = VirtualClock()
    core = EngineCore(make("fcfs"), clock)
    core.add(req("a", 8))
    core.add(req("b", 8))
    core.abort("a")
    assert [(d.job_id, d.finish_reason) for d in core.fail_all()] == [("b", "error")]
    assert not core.has_work()


def test_a_virtual_clock_never_goes_back() -> None:
    clock = VirtualClock(3.0)
    clock.advance(0.25)
    assert clock() == 3.25
    with pytest.raises(ValueError, match="-1"):
        clock.advance(-1)
