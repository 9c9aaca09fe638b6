"""Discrete-event replay of a workload through the real ``Scheduler`` and ``KVCacheManager``.

Owns the one simulated-time loop (``EventLoop``): it drives the server's own ``EngineCore`` on a
``VirtualClock`` — ``schedule`` while a pipeline stage is free, ``SimPipeline`` (the cost model)
prices the plan, ``update`` at its completion — with no copy of the server's logic, Ray or torch.
Outputs have fixed lengths (``ignore_eos``). Observed: per-request records, KV blocks in use over
time (Figure 8), the scheduler's counters.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from fastserve.bench.metrics import STATUS_OK, RequestRecord
from fastserve.bench.sim.cost import CostModel
from fastserve.bench.sim.pipeline import ScriptedTokens, SimPipeline, constant_tokens
from fastserve.bench.workloads import BOS_TOKEN_ID, Request
from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.errors import RequestError
from fastserve.scheduler.config import EngineConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.job import JobRequest, JobStats, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput

OPT_EOS_TOKEN_ID = BOS_TOKEN_ID
#: The id every simulated step "samples": an ordinary token, never EOS (ignore_eos anyway).
FAKE_TOKEN_ID = 4
STATUS_REJECTED = "rejected"     # the scheduler refused it (too large for the pool, queue full)
STATUS_UNFINISHED = "unfinished"  # still running when the simulated time limit was reached
STATUS_ERROR = "error"
#: Consecutive idle polls with work queued but nothing runnable before the loop gives up.
MAX_IDLE_POLLS = 100_000


class SimStalled(RuntimeError):
    """Jobs remain, the scheduler runs nothing, and no time-driven rule freed it."""


@dataclass(frozen=True)
class SimOptions:
    eos_token_ids: frozenset[int] = frozenset({OPT_EOS_TOKEN_ID})
    token_id: int = FAKE_TOKEN_ID
    #: Re-ask the scheduler this often when it is idle with work queued (the engine's idle poll).
    idle_poll_s: float = EngineConfig().idle_poll_s
    #: Stop replaying at this simulated time; requests not done are "unfinished".
    max_sim_time_s: float = math.inf
    check_invariants: bool = False


@dataclass
class KVTimeline:
    """Blocks in use after every change: (time, device blocks used, host blocks used)."""

    bytes_per_block: int
    device_capacity: int
    host_capacity: int
    points: list[tuple[float, int, int]] = field(default_factory=list)

    def observe(self, now: float, device_used: int, host_used: int) -> None:
        last = self.points[-1] if self.points else None
        if last is not None and last[1:] == (device_used, host_used):
            return
        if last is not None and last[0] == now:
            self.points[-1] = (now, device_used, host_used)
        else:
            self.points.append((now, device_used, host_used))

    @property
    def peak_device_blocks(self) -> int:
        return max((p[1] for p in self.points), default=0)

    @property
    def peak_host_blocks(self) -> int:
        return max((p[2] for p in self.points), default=0)


@dataclass
class SimResult:
    requests: list[Request]
    records: list[RequestRecord]          # same order as ``requests``
    completion_order: list[str]           # request ids in the order they finished
    kv: KVTimeline
    stats: dict[str, JobStats]            # scheduler accounting of every finished job
    totals: dict[str, int]
    makespan_s: float
    steps: int
    busy_compute_s: float
    busy_pcie_s: float
    wall_s: float

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.requests), "steps": self.steps, "makespan_s": self.makespan_s,
                "peak_device_blocks": self.kv.peak_device_blocks,
                "peak_host_blocks": self.kv.peak_host_blocks, "totals": dict(self.totals),
                "wall_s": self.wall_s}


@dataclass
class _Trace:
    """What the loop saw of one request."""

    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    status: str = STATUS_UNFINISHED


@dataclass(frozen=True)
class LoopHooks:
    """``settled``: after each round of dispatching; without ``refused`` a refusal is raised."""

    deltas: Callable[[list[TokenDelta], float], None]
    plan: Callable[[BatchPlan, float], None] | None = None
    settled: Callable[[float], None] | None = None
    refused: Callable[[JobRequest, RequestError], None] | None = None


class EventLoop:
    """Simulated time around one ``EngineCore``. Idle with work waiting, the scheduler is asked again
    every ``idle_poll_s`` (starvation promotion may free it); ``max_plans`` bounds a livelock."""

    def __init__(self, core: EngineCore, clock: VirtualClock, pipeline: SimPipeline, *,
                 idle_poll_s: float = EngineConfig().idle_poll_s, max_time_s: float = math.inf,
                 max_plans: int | None = None, max_idle_polls: int = MAX_IDLE_POLLS) -> None:
        self.core = core
        self.clock = clock
        self.pipeline = pipeline
        self.idle_poll_s = idle_poll_s
        self.max_time_s = max_time_s
        self.max_plans = max_plans
        self.max_idle_polls = max_idle_polls
        self.plans = 0
        self._inflight: list[tuple[float, int, BatchPlan, StepOutput]] = []   # heap by completion
        self._seq = count()

    def run(self, arrivals: Iterable[tuple[float, JobRequest]], hooks: LoopHooks) -> None:
        pending = iter(arrivals)
        upcoming = next(pending, None)
        idle_polls = 0
        while True:
            while upcoming is not None and upcoming[0] <= self.clock.now:
                self._add(upcoming[1], hooks)
                upcoming = next(pending, None)
            self._dispatch(hooks)
            if hooks.settled is not None:
                hooks.settled(self.clock.now)
            next_done = self._inflight[0][0] if self._inflight else math.inf
            next_arrival = math.inf if upcoming is None else upcoming[0]
            if math.isinf(next_done) and math.isinf(next_arrival):
                if not self.core.has_work():
                    return
                idle_polls += 1
                if idle_polls > self.max_idle_polls:
                    raise SimStalled(f"{len(self.core.scheduler.jobs())} jobs left at t={self.clock.now:.3f}s, "
                                     "nothing runs")
                next_arrival = self.clock.now + self.idle_poll_s
            event = min(next_arrival, next_done)
            if event > self.max_time_s:
                return
            self.clock.now = event
            if next_done <= next_arrival:
                idle_polls = 0
                _, _, plan, output = heapq.heappop(self._inflight)
                hooks.deltas(self.core.update(plan, output).deltas, self.clock.now)

    def _add(self, req: JobRequest, hooks: LoopHooks) -> None:
        try:
            self.core.add(req)
        except RequestError as exc:
            if hooks.refused is None:
                raise
            hooks.refused(req, exc)

    def _dispatch(self, hooks: LoopHooks) -> None:
        while self.core.scheduler.num_inflight() < self.pipeline.stages:
            plan = self.core.schedule()
            if plan is None:
                return
            self.plans += 1
            if self.max_plans is not None and self.plans > self.max_plans:
                raise RuntimeError(f"no end after {self.max_plans} plans (a livelock?)")
            done = self.pipeline.dispatch(plan, self.clock.now)
            heapq.heappush(self._inflight, (done.completion, next(self._seq), plan, done.output))
            if hooks.plan is not None:
                hooks.plan(plan, self.clock.now)


class Simulator:
    """One replay: a fresh ``Scheduler`` and pipeline; call ``run`` once per instance."""

    def __init__(self, cost: CostModel, scheduler_config: SchedulerConfig, kv_config: KVCacheConfig,
                 options: SimOptions | None = None, scheduler_profile: Profile | None = None) -> None:
        """``scheduler_profile``: what the scheduler believes, when not the simulated ``cost``."""
        self.cost = cost
        self.options = options or SimOptions()
        self.scheduler = Scheduler(scheduler_config, kv_config, scheduler_profile or cost.profile,
                                   self.options.eos_token_ids)
        self.clock = VirtualClock()
        self.core = EngineCore(self.scheduler, self.clock,
                               check_invariants=self.options.check_invariants)
        self.pipeline = SimPipeline(cost, ScriptedTokens(constant_tokens(self.options.token_id)))
        self.loop = EventLoop(self.core, self.clock, self.pipeline, idle_poll_s=self.options.idle_poll_s,
                              max_time_s=self.options.max_sim_time_s)
        self._fillers: dict[int, tuple[int, ...]] = {}
        # A prompt's second token is its own: identical synthetic prompts would share one cached prefix.
        self._prompt_tags = count(max(BOS_TOKEN_ID, OPT_EOS_TOKEN_ID, self.options.token_id) + 1)

    def _prompt(self, n: int) -> tuple[int, ...]:
        if n <= 1:
            return (BOS_TOKEN_ID,)[:n]
        if n not in self._fillers:
            self._fillers[n] = (self.options.token_id,) * (n - 2)
        return (BOS_TOKEN_ID, next(self._prompt_tags)) + self._fillers[n]

    def _job(self, req: Request) -> JobRequest:
        sampling = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        return JobRequest(req.request_id, self._prompt(req.prompt_len), sampling, req.arrival_s)

    def run(self, requests: Sequence[Request]) -> SimResult:
        started = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        kv = self.scheduler.kv
        timeline = KVTimeline(self.cost.profile.swap_bytes_per_block, kv.device.capacity, kv.host.capacity)
        traces = {r.request_id: _Trace() for r in reqs}
        order: list[str] = []
        stats: dict[str, JobStats] = {}

        def observe(now: float) -> None:
            timeline.observe(now, kv.device.capacity - kv.num_free_device, kv.host.capacity - kv.num_free_host)

        def on_deltas(deltas: list[TokenDelta], now: float) -> None:
            for d in deltas:
                trace = traces[d.job_id]
                if d.token_id is not None:
                    trace.token_times.append(now)
                if d.finished:
                    trace.end = now
                    trace.status = STATUS_OK if d.finish_reason in ("length", "stop") else STATUS_ERROR
                    order.append(d.job_id)
            for st in self.scheduler.drain_finished():
                stats[st.job_id] = st
            observe(now)

        def on_refused(req: JobRequest, exc: RequestError) -> None:
            traces[req.job_id].status = STATUS_REJECTED

        self.loop.run(((r.arrival_s, self._job(r)) for r in reqs), LoopHooks(on_deltas, None, observe, on_refused))
        records = [_record(r, traces[r.request_id], stats.get(r.request_id)) for r in reqs]
        return SimResult(reqs, records, order, timeline, stats, dict(self.scheduler.totals),
                         self.clock.now, self.core.steps, self.pipeline.busy_compute_s,
                         self.pipeline.busy_pcie_s, time.perf_counter() - started)


def _record(req: Request, trace: _Trace, st: JobStats | None) -> RequestRecord:
    times = tuple(trace.token_times)
    return RequestRecord(
        arrival=req.arrival_s,
        first_token=times[0] if times else None,
        end=trace.end,
        output_tokens=len(times),
        status=trace.status,
        token_times=times,
        queue_s=None if st is None else st.queueing_s,
        exec_s=None if st is None else st.execution_s,
        swap_s=None if st is None else st.swap_blocked_s,
    )
