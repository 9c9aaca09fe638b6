"""A scripted data plane priced by the simulator's ``CostModel``, and a small event loop for tests.

``CostModelExecutor`` answers a ``BatchPlan`` like an executor would — one token per entry, from
a per-job script — and reports the plan's time from ``fastserve.bench.sim.cost.CostModel`` (the one cost
model: the simulator, the scheduler's tests and its benchmark all price plans with it). ``drive``
replays arrivals through an ``EngineCore`` on a virtual clock with up to P plans in flight between
the step's two halves, calling an observer after every decision and update (the rule and
property tests). For paper-scale replays with metrics, use ``fastserve.bench.sim.simulate``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fastserve.bench.sim.cost import CostModel
from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import BatchPlan, StepOutput

#: (job id, index of the token in the job's output) -> token id
TokenScript = Callable[[str, int], int]


def constant_tokens(token_id: int) -> TokenScript:
    return lambda job_id, index: token_id


class CostModelExecutor:
    """Plan time = the cost model's compute, plus the swap copies its forward must wait for
    (``CostModel.blocking_swap_seconds``); background swaps overlap the forward and only
    stretch the step when they take longer."""

    max_inflight = 1

    def __init__(self, cost: CostModel | Profile, tokens: TokenScript) -> None:
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost)
        self.tokens = tokens
        self.plans = 0

    def timings(self, plan: BatchPlan) -> dict[str, float]:
        swapped = sum(len(c.src_blocks) for c in (*plan.swap_in, *plan.swap_out))
        wait = self.cost.blocking_swap_seconds(plan)
        forward_done = wait + self.cost.compute_seconds(plan)
        total = max(forward_done, self.cost.swap_seconds(swapped))
        return {"total": total, "swap_wait": wait, "swap_tail": total - forward_done}

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.plans += 1
        tokens = {e.job_id: self.tokens(e.job_id, e.step_index) for e in plan.entries if e.samples}
        return StepOutput(plan.step_id, tokens, self.timings(plan))


@dataclass
class DriveResult:
    finish_times: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str | None] = field(default_factory=dict)
    plans: int = 0
    end_time: float = 0.0


class Stalled(RuntimeError):
    """Work remains but nothing can run and nothing is in flight (a deadlock)."""


Observer = Callable[[Scheduler, BatchPlan | None, float], None]


def drive(scheduler: Scheduler, executor: CostModelExecutor,
          arrivals: Iterable[tuple[float, JobRequest]], *, pipeline_depth: int = 1,
          max_plans: int | None = None, observe: Observer | None = None) -> DriveResult:
    """Run until every job finished. Plans take their reported time; with a depth-P pipeline a
    new plan may start every total/P seconds while up to P are in flight; outputs return in
    order. ``observe(scheduler, plan, now)`` runs after every schedule (plan) and update (None).
    Raises ``Stalled`` on a deadlock and ``RuntimeError`` past ``max_plans`` (a livelock)."""
    pending = deque(sorted(arrivals, key=lambda a: a[0]))
    inflight: deque[tuple[float, BatchPlan, StepOutput]] = deque()
    result = DriveResult()
    clock = VirtualClock()
    core = EngineCore(scheduler, clock)
    stage_free = 0.0

    def collect(deltas: list[TokenDelta]) -> None:
        for d in deltas:
            if d.token_id is not None:
                result.tokens.setdefault(d.job_id, []).append(d.token_id)
            if d.finished:
                result.finish_times[d.job_id] = clock.now
                result.reasons[d.job_id] = d.finish_reason

    while True:
        now = clock.now
        while pending and pending[0][0] <= now:
            core.add(pending.popleft()[1])
        if len(inflight) < pipeline_depth and now >= stage_free:
            plan = core.schedule()
            if plan is not None:
                out = executor.execute(plan)
                total = out.timings["total"]
                inflight.append((now + total, plan, out))
                stage_free = now + total / pipeline_depth
                result.plans += 1
                if max_plans is not None and result.plans > max_plans:
                    raise RuntimeError(f"no completion after {max_plans} plans (livelock?)")
                if observe is not None:
                    observe(scheduler, plan, now)
                continue
        events = [inflight[0][0]] if inflight else []
        if pending:
            events.append(pending[0][0])
        if inflight and len(inflight) < pipeline_depth and stage_free > now:
            events.append(stage_free)
        if not events:
            if scheduler.has_work():
                raise Stalled(f"t={now}: work remains but nothing is scheduled: "
                              f"{scheduler.stats()}")
            break
        clock.now = now = max(now, min(events))
        while inflight and inflight[0][0] <= now:
            _, plan, out = inflight.popleft()
            collect(core.update(plan, out).deltas)
            if observe is not None:
                observe(scheduler, None, now)
    result.end_time = clock.now
    return result
