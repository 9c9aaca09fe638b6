"""A test's jobs through the simulator's loop, and a scripted executor priced by its cost model.

``drive`` runs arrivals through an ``EngineCore`` over a given ``Scheduler`` on the simulator's
own ``EventLoop`` and ``SimPipeline`` (up to ``pipeline_depth`` plans in flight), calling an
observer after every plan and every update (the rule and property tests) and collecting each
job's tokens, finish and finish time. The executor makes the tokens (a script, or a real model
whose tokens a test checks); the cost model prices the plans. For paper-scale replays with
metrics, use ``fastserve.bench.sim.simulate``.

``CostModelExecutor`` is the same pricing for callers that run one plan at a time on a clock of
their own (``AsyncEngine`` tests, ``fastserve.bench.bench_scheduler``): a plan's time is what an
idle ``SimPipeline`` says it takes.
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
    """Tokens from a script; a plan's timings from the cost model, as an idle pipeline runs it
    (the forward waits for the swaps touching its blocks; the rest overlap it)."""

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
    """Run until every job finished, from t = 0. ``executor`` makes each plan's tokens, ``cost``
    (default: a ``CostModelExecutor``'s own) prices it on a ``pipeline_depth``-stage pipeline.
    ``observe(scheduler, plan, now)`` runs after every plan (plan) and update (None). Raises
    ``SimStalled`` when work remains that nothing will run, ``RuntimeError`` past ``max_plans``
    plans (a livelock)."""
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
