"""A test's jobs through the simulator's ``EventLoop`` (``drive``, for the rule and property tests),
and ``CostModelExecutor``, the same pricing for callers with a clock of their own. For paper-scale
replays with metrics, use ``fastserve.bench.sim.simulate``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fastserve.bench.sim.cost import CostModel
from fastserve.bench.sim.pipeline import ScriptedTokens, SimPipeline, TokenScript, constant_tokens
from fastserve.bench.sim.simulator import EventLoop, LoopHooks, SimStalled
from fastserve.engine.core import EngineCore, SyncExecutor, VirtualClock
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import BatchPlan, StepOutput

__all__ = ["CostModelExecutor", "DriveResult", "SimStalled", "TokenScript", "constant_tokens", "drive"]


class CostModelExecutor:
    """Tokens from a script; timings as an idle ``SimPipeline`` prices the plan."""

    max_inflight = 1

    def __init__(self, cost: CostModel | Profile, tokens: TokenScript) -> None:
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost)
        self.tokens = ScriptedTokens(tokens)
        self.plans = 0

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.plans += 1
        return SimPipeline(self.cost, self.tokens).dispatch(plan, 0.0).output


@dataclass
class DriveResult:
    finish_times: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str | None] = field(default_factory=dict)
    plans: int = 0
    end_time: float = 0.0


Observer = Callable[[Scheduler, BatchPlan | None, float], None]


def drive(scheduler: Scheduler, executor: SyncExecutor, arrivals: Iterable[tuple[float, JobRequest]], *,
          cost: CostModel | None = None, pipeline_depth: int = 1, max_plans: int | None = None,
          observe: Observer | None = None) -> DriveResult:
    """Until every job finished; ``observe(scheduler, plan, now)`` after every plan and update (None).
    ``SimStalled`` when nothing will run the rest; ``RuntimeError`` past ``max_plans`` (a livelock)."""
    if cost is None:
        if not isinstance(executor, CostModelExecutor):
            raise TypeError("drive: pass cost= to price an executor that is not a CostModelExecutor")
        cost = executor.cost
    clock = VirtualClock()
    loop = EventLoop(EngineCore(scheduler, clock), clock, SimPipeline(cost, executor, pipeline_depth),
                     max_plans=max_plans)
    result = DriveResult()

    def collect(deltas: list[TokenDelta], now: float) -> None:
        for d in deltas:
            result.tokens.setdefault(d.job_id, []).extend(d.token_ids)
            if d.finished:
                result.finish_times[d.job_id] = now
                result.reasons[d.job_id] = d.finish_reason
        if observe is not None:
            observe(scheduler, None, now)

    def planned(plan: BatchPlan, now: float) -> None:
        if observe is not None:
            observe(scheduler, plan, now)

    loop.run(sorted(arrivals, key=lambda a: a[0]), LoopHooks(collect, planned))
    result.plans = loop.plans
    result.end_time = clock.now
    return result
